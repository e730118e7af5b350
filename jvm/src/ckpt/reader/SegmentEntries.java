package ckpt.reader;

import com.github.luben.zstd.Zstd;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Comparator;
import java.util.HashSet;
import java.util.List;
import java.util.Set;

/**
 * The live entries of one state of a memory-backend subtask, straight from its files
 * (statebackend.state.memory_files: ``CKPTKGS1``/``CKPTKGS2``, no compression or zstd;
 * per family its sorted keys as an Arrow-style binary array and its values either the
 * same way or, fixed-width, as byte planes), key groups in order. Each file is read
 * only for the key groups the subtask takes from it, with the checks of the Python
 * reader (statebackend.state.memory.key_group_sections): offsets inside their data,
 * entries in key order, a key-group file holding its own key group only, and every key
 * group the subtask reads from a file present in it.
 */
final class SegmentEntries extends Entries {
    private static final byte[] MAGIC_2 = "CKPTKGS2".getBytes(StandardCharsets.US_ASCII);
    private static final byte[] MAGIC_1 = "CKPTKGS1".getBytes(StandardCharsets.US_ASCII);

    /** One family of a file: where its keys and values are in the payload. */
    private record Family(String name, byte[] payload, int entries, int width, int keyOffsets,
                          int keyData, int valueOffsets, int valueData) {
        int keyStart(int i) {
            return keyData + (int) SstFile.le32(payload, keyOffsets + 4 * i);
        }

        int keyEnd(int i) {
            return keyData + (int) SstFile.le32(payload, keyOffsets + 4 * i + 4);
        }

        int keyGroup(int i) {
            int at = keyStart(i);
            return (payload[at] & 0xff) << 8 | (payload[at + 1] & 0xff);
        }
    }

    private record Section(int keyGroup, Family family, int from, int to) {
    }

    private final List<Section> sections;
    private int section;
    private int at;
    private byte[] row = new byte[0];

    private SegmentEntries(List<Section> sections) {
        this.sections = sections;
        this.at = sections.isEmpty() ? 0 : sections.get(0).from();
    }

    static SegmentEntries open(StoredFiles stored, ReadPlan.SubtaskFiles subtask, String state)
            throws IOException {
        List<Section> sections = new ArrayList<>();
        String label = "subtask " + subtask.index() + " (memory backend)";
        for (ReadPlan.StoredFile f : subtask.files()) {
            List<Family> families;
            try {
                families = families(stored.readChecked(f));
            } catch (IllegalArgumentException | IndexOutOfBoundsException e) {
                throw new IOException(f.path() + ": not a readable key-group file of " + label + ": "
                    + e.getMessage(), e);
            }
            int[] wanted = f.keyGroups().stream().mapToInt(Integer::intValue).sorted().distinct().toArray();
            boolean whole = f.localName().startsWith("kg-");
            Set<Integer> present = new HashSet<>();
            for (Family family : families) {
                for (int i = 1; i < family.entries(); i++) {
                    if (family.keyGroup(i) < family.keyGroup(i - 1)) {
                        throw new IOException(f.path() + ": entries out of key order (" + label + ")");
                    }
                }
                int n = family.entries();
                if (whole && wanted.length > 0 && n > 0
                        && (family.keyGroup(0) != wanted[0] || family.keyGroup(n - 1) != wanted[0])) {
                    throw new IOException(f.path() + ": holds keys outside key group " + wanted[0] + " (" + label + ")");
                }
                for (int kg : wanted) {
                    int from = firstAtLeast(family, kg), to = firstAtLeast(family, kg + 1);
                    if (to > from) {
                        present.add(kg);
                        if (family.name().equals(state)) sections.add(new Section(kg, family, from, to));
                    }
                }
            }
            for (int kg : wanted) {
                if (!present.contains(kg)) {
                    throw new IOException(f.path() + ": holds no entry of key group " + kg + ", which " + label
                        + " reads from it");
                }
            }
        }
        sections.sort(Comparator.comparingInt(Section::keyGroup));
        return new SegmentEntries(sections);
    }

    private static int firstAtLeast(Family family, int keyGroup) {
        int lo = 0, hi = family.entries();
        while (lo < hi) {
            int mid = (lo + hi) >>> 1;
            if (family.keyGroup(mid) < keyGroup) lo = mid + 1; else hi = mid;
        }
        return lo;
    }

    /** The families of a file's bytes; IllegalArgumentException when it is not one. */
    private static List<Family> families(byte[] data) {
        boolean layouts;
        if (Arrays.equals(data, 0, 8, MAGIC_2, 0, 8)) layouts = true;
        else if (Arrays.equals(data, 0, 8, MAGIC_1, 0, 8)) layouts = false;
        else throw new IllegalArgumentException("not a key-group file (bad magic)");
        int codec = data[8] & 0xff;
        long size = SstFile.le64(data, 9);
        if (size > Integer.MAX_VALUE - 64) throw new IllegalArgumentException("a payload over 2 GiB");
        byte[] payload;
        if (codec == 0) {
            payload = Arrays.copyOfRange(data, 17, data.length);
        } else if (codec == 1) {
            payload = Zstd.decompress(Arrays.copyOfRange(data, 17, data.length), (int) size);
        } else {
            throw new IllegalArgumentException("unknown codec " + codec);
        }
        if (payload.length != size) {
            throw new IllegalArgumentException("payload is " + payload.length + " bytes, header says " + size);
        }
        int[] pos = {0};
        int count = (int) u16(payload, pos);
        List<Object[]> heads = new ArrayList<>();
        for (int f = 0; f < count; f++) {
            int length = (int) u16(payload, pos);
            String name = new String(payload, take(payload, pos, length), length, StandardCharsets.UTF_8);
            long entries = SstFile.le32(payload, take(payload, pos, 4));
            int layout = 0, width = 0;
            if (layouts) {
                layout = payload[take(payload, pos, 1)] & 0xff;
                width = (int) u16(payload, pos);
            }
            if (layout > 1 || (layout == 1) != (width > 0)) {
                throw new IllegalArgumentException("family '" + name + "': unknown values layout " + layout);
            }
            long keyBytes = SstFile.le64(payload, take(payload, pos, 8));
            long valueBytes = SstFile.le64(payload, take(payload, pos, 8));
            heads.add(new Object[] {name, entries, width, keyBytes, valueBytes});
        }
        List<Family> out = new ArrayList<>();
        for (Object[] h : heads) {
            int entries = (int) (long) (Long) h[1];
            int width = (Integer) h[2];
            int keyOffsets = take(payload, pos, 4L * (entries + 1));
            int keyData = take(payload, pos, (Long) h[3]);
            checkOffsets(payload, keyOffsets, entries, (Long) h[3], (String) h[0]);
            int valueOffsets = -1, valueData;
            if (width > 0) {
                if ((Long) h[4] != (long) entries * width) {
                    throw new IllegalArgumentException("family '" + h[0] + "': " + h[4] + " bytes of values, not "
                        + entries + " x " + width);
                }
                valueData = take(payload, pos, (Long) h[4]);
            } else {
                valueOffsets = take(payload, pos, 4L * (entries + 1));
                valueData = take(payload, pos, (Long) h[4]);
                checkOffsets(payload, valueOffsets, entries, (Long) h[4], (String) h[0]);
            }
            out.add(new Family((String) h[0], payload, entries, width, keyOffsets, keyData, valueOffsets, valueData));
        }
        if (pos[0] != payload.length) {
            throw new IllegalArgumentException((payload.length - pos[0]) + " bytes after the last family");
        }
        return out;
    }

    private static void checkOffsets(byte[] b, int at, int entries, long size, String family) {
        long previous = SstFile.le32(b, at);
        if (previous != 0) throw new IllegalArgumentException("family '" + family + "': offsets do not start at 0");
        for (int i = 1; i <= entries; i++) {
            long next = SstFile.le32(b, at + 4 * i);
            if (next < previous || next > size) {
                throw new IllegalArgumentException("family '" + family + "': offset " + next + " out of order or "
                    + "past its " + size + " bytes");
            }
            previous = next;
        }
    }

    private static long u16(byte[] b, int[] pos) {
        int at = take(b, pos, 2);
        return (b[at] & 0xff) | (b[at + 1] & 0xff) << 8;
    }

    /** Where the next ``n`` bytes start; moves past them (IllegalArgumentException past the end). */
    private static int take(byte[] b, int[] pos, long n) {
        if (n < 0 || pos[0] + n > b.length) throw new IllegalArgumentException("truncated");
        int at = pos[0];
        pos[0] += (int) n;
        return at;
    }

    @Override
    boolean next() {
        while (section < sections.size() && at >= sections.get(section).to()) {
            section++;
            if (section < sections.size()) at = sections.get(section).from();
        }
        if (section >= sections.size()) return false;
        Family f = sections.get(section).family();
        int i = at++;
        key = f.payload();
        keyOffset = f.keyStart(i);
        keyLength = f.keyEnd(i) - keyOffset;
        if (f.width() == 0) {
            value = f.payload();
            valueOffset = f.valueData() + (int) SstFile.le32(value, f.valueOffsets() + 4 * i);
            valueLength = f.valueData() + (int) SstFile.le32(value, f.valueOffsets() + 4 * i + 4) - valueOffset;
        } else {  // byte planes: byte j of entry i is at plane j
            int width = f.width(), n = f.entries();
            if (row.length < width) row = new byte[width];
            byte[] p = f.payload();
            for (int j = 0, src = f.valueData() + i; j < width; j++, src += n) row[j] = p[src];
            value = row;
            valueOffset = 0;
            valueLength = width;
        }
        return true;
    }

    @Override
    public void close() {
    }
}
