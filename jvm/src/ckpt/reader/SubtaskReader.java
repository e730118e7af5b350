package ckpt.reader;

import org.apache.spark.sql.connector.read.PartitionReader;
import org.apache.spark.sql.execution.vectorized.OnHeapColumnVector;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.vectorized.ColumnarBatch;

import java.io.IOException;
import java.nio.channels.FileChannel;
import java.nio.file.Files;
import java.nio.file.LinkOption;
import java.nio.file.Path;
import java.nio.file.StandardOpenOption;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.ArrayList;
import java.util.HexFormat;
import java.util.List;

/**
 * One subtask's part of a read, as columnar batches: hold the checkpoint (a hold
 * lease), check that ``_metadata`` is still the planned one, check each file against
 * its recorded size and checksum, then decode the state's live entries (key groups of
 * the subtask only; TTL entries expired at the checkpoint's clock left out) into the
 * columns asked for. The layout decoded is the Python library's
 * (statebackend.state.codecs): key = 2-byte big-endian key group + UTF-8 key; value =
 * [8-byte big-endian expiry, offset by 2^63, for TTL states] + a format byte + the
 * codec's bytes (a record: its fields little-endian, in declared order).
 */
final class SubtaskReader implements PartitionReader<ColumnarBatch> {
    private static final byte RECORD_FORMAT = 0x02, BYTES_FORMAT = 0x03, STR_FORMAT = 0x04;
    private static final long MAX_MS = Long.MAX_VALUE / 1000;  // the widest ms a timestamp holds
    private static final int KEY = 0, KEY_GROUP = 1, SUBTASK = 2, EXPIRES = 3, VALUE = 4,
        INT64 = 5, FLOAT64 = 6, INT32 = 7, FLOAT32 = 8, BOOL = 9;

    private final ReadPlan plan;
    private final ReadPlan.SubtaskFiles subtask;
    private final int[] kinds;        // per output column
    private final int[] offsets;      // a record field's offset in the value
    private final OnHeapColumnVector[] vectors;
    private final ColumnarBatch batch;
    private final int ttlBytes;
    private final int valueSize;      // a record's stored size with its format byte; -1: any
    private final byte format;
    private final String label;
    private HoldLease lease;
    private Entries entries;

    SubtaskReader(ReadPlan plan, int index, StructType schema) {
        this.plan = plan;
        this.subtask = plan.subtaskFiles().get(index);
        this.label = "state '" + plan.state() + "' of subtask " + index;
        ttlBytes = plan.ttl() ? 8 : 0;
        StructField[] columns = schema.fields();
        kinds = new int[columns.length];
        offsets = new int[columns.length];
        vectors = OnHeapColumnVector.allocateColumns(plan.batchRows(), schema);
        int recordSize = 1;
        java.util.Map<String, Integer> fieldOffsets = new java.util.HashMap<>();
        java.util.Map<String, Integer> fieldKinds = new java.util.HashMap<>();
        for (ReadPlan.Field f : plan.fields()) {
            fieldOffsets.put(f.name(), ttlBytes + recordSize);
            int kind = switch (f.type()) {
                case "int64" -> INT64;
                case "float64" -> FLOAT64;
                case "int32" -> INT32;
                case "float32" -> FLOAT32;
                case "bool" -> BOOL;
                default -> throw new IllegalArgumentException(label + ": record field type " + f.type());
            };
            fieldKinds.put(f.name(), kind);
            recordSize += kind == INT64 || kind == FLOAT64 ? 8 : kind == BOOL ? 1 : 4;
        }
        switch (plan.codec()) {
            case "record" -> { valueSize = ttlBytes + recordSize; format = RECORD_FORMAT; }
            case "str" -> { valueSize = -1; format = STR_FORMAT; }
            case "bytes" -> { valueSize = -1; format = BYTES_FORMAT; }
            default -> throw new IllegalArgumentException(label + ": codec " + plan.codec());
        }
        for (int i = 0; i < columns.length; i++) {
            String name = columns[i].name();
            kinds[i] = switch (name) {
                case "key" -> KEY;
                case "key_group" -> KEY_GROUP;
                case "subtask" -> SUBTASK;
                case "expires_at" -> EXPIRES;
                case "value" -> VALUE;
                default -> {
                    Integer kind = fieldKinds.get(name);
                    if (kind == null) throw new IllegalArgumentException(label + ": no column " + name);
                    offsets[i] = fieldOffsets.get(name);
                    yield kind;
                }
            };
        }
        batch = new ColumnarBatch(vectors);
    }

    @Override
    public boolean next() throws IOException {
        if (entries == null) open();
        for (OnHeapColumnVector v : vectors) v.reset();
        int rows = 0;
        int capacity = plan.batchRows();
        while (rows < capacity && entries.next()) {
            byte[] key = entries.key;
            int k = entries.keyOffset;
            int keyLength = entries.keyLength;
            if (keyLength < 2) throw new IOException(label + ": a stored key is shorter than its key-group prefix");
            int keyGroup = (key[k] & 0xff) << 8 | (key[k + 1] & 0xff);
            if (keyGroup < subtask.keyGroupStart() || keyGroup > subtask.keyGroupEnd()) continue;
            byte[] value = entries.value;
            int at = entries.valueOffset;
            int length = entries.valueLength;
            if (length < ttlBytes + 1 || value[at + ttlBytes] != format
                    || (valueSize >= 0 && length != valueSize)) {
                throw new IOException(badValue(length));
            }
            long expiry = ttlBytes == 0 ? 0 : SstFile.be64(value, at) ^ Long.MIN_VALUE;
            if (ttlBytes != 0 && plan.now() != null && expiry <= plan.now()) continue;
            for (int c = 0; c < kinds.length; c++) {
                OnHeapColumnVector v = vectors[c];
                switch (kinds[c]) {
                    case KEY -> v.putByteArray(rows, key, k + 2, keyLength - 2);
                    case KEY_GROUP -> v.putInt(rows, keyGroup);
                    case SUBTASK -> v.putInt(rows, subtask.index());
                    case EXPIRES -> v.putLong(rows, Math.max(-MAX_MS, Math.min(MAX_MS, expiry)) * 1000);
                    case VALUE -> v.putByteArray(rows, value, at + ttlBytes + 1, length - ttlBytes - 1);
                    case INT64 -> v.putLong(rows, SstFile.le64(value, at + offsets[c]));
                    case FLOAT64 -> v.putDouble(rows, Double.longBitsToDouble(SstFile.le64(value, at + offsets[c])));
                    case INT32 -> v.putInt(rows, (int) SstFile.le32(value, at + offsets[c]));
                    case FLOAT32 -> v.putFloat(rows, Float.intBitsToFloat((int) SstFile.le32(value, at + offsets[c])));
                    default -> v.putBoolean(rows, value[at + offsets[c]] != 0);
                }
            }
            rows++;
        }
        batch.setNumRows(rows);
        return rows > 0;
    }

    private String badValue(int length) {
        if ("record".equals(plan.codec()) && length != valueSize) {
            return label + ": record value of " + (length - ttlBytes) + " bytes does not match its layout of "
                + (valueSize - ttlBytes) + " bytes";
        }
        return label + ": " + plan.codec() + " value with an unknown format byte";
    }

    @Override
    public ColumnarBatch get() {
        return batch;
    }

    /** Hold, check, open (class doc); errors name the state and the subtask. */
    private void open() throws IOException {
        try {
            holdCheckOpen();
        } catch (IOException e) {
            throw new IOException(label + ": " + e.getMessage(), e);
        }
    }

    private void holdCheckOpen() throws IOException {
        lease = new HoldLease(Path.of(plan.leasesDir()), "read_state '" + plan.state() + "' of checkpoint "
            + plan.checkpointId() + ", subtask " + subtask.index(), plan.checkpointId(),
            plan.leaseTtlSeconds(), plan.leaseHeartbeatSeconds());
        pause();
        checkMetadata();
        entries = entriesOf();
    }

    private void checkMetadata() throws IOException {
        Path meta = Path.of(plan.metadataPath());
        byte[] data = Files.exists(meta, LinkOption.NOFOLLOW_LINKS) ? Files.readAllBytes(meta) : null;
        String digest;
        try {
            digest = data == null ? null : HexFormat.of().formatHex(MessageDigest.getInstance("SHA-256").digest(data));
        } catch (NoSuchAlgorithmException e) {
            throw new IOException(e);
        }
        if (!plan.recordDigest().equals(digest)) {
            throw new IOException("checkpoint " + plan.checkpointId() + " of job '" + plan.job() + "' was retired "
                + "or replaced after read_state planned the read; read it again (`ckpt list` shows what is kept)");
        }
    }

    /** Memory-backend files, else the SST files of the state read directly, else the
     *  instance through RocksDB. */
    private Entries entriesOf() throws IOException {
        StoredFiles stored = new StoredFiles(subtask.localSnapshot());
        if (plan.memory()) return SegmentEntries.open(stored, subtask, plan.state());
        List<SstFile> mine = new ArrayList<>();
        List<FileChannel> channels = new ArrayList<>();
        boolean direct = plan.direct();
        try {
            for (ReadPlan.StoredFile f : subtask.files()) {
                String local = f.localName();
                if (local.endsWith(".log") && f.size() > 0 || local.endsWith(".blob")) direct = false;
                if (!direct || !local.endsWith(".sst")) continue;
                SstFile sst = null;
                IOException mismatch = null;
                for (Path path : stored.candidates(f)) {
                    FileChannel channel = FileChannel.open(path, StandardOpenOption.READ, LinkOption.NOFOLLOW_LINKS);
                    channels.add(channel);
                    sst = new SstFile(path.toString(), channel);
                    String family = sst.columnFamily();
                    if (family == null || family.isEmpty() || !plan.state().equals(family)) break;
                    mismatch = StoredFiles.mismatch(f, path, StoredFiles.crc(sst.load(), f.checksum()));
                    if (mismatch == null) break;
                }
                if (mismatch != null) throw mismatch;
                String family = sst.columnFamily();
                if (family == null || family.isEmpty()) {
                    direct = false;  // an ingested file: its column family is in the MANIFEST only
                } else if (plan.state().equals(family)) {
                    mine.add(sst);
                }
            }
            if (direct && mine.size() > 1 && mine.stream().anyMatch(SstFile::external)) direct = false;
        } catch (SstFile.Unsupported e) {
            direct = false;
        } finally {
            for (FileChannel c : channels) c.close();
        }
        if (direct) return new Entries.Direct(mine);
        List<String[]> files = new ArrayList<>();
        for (ReadPlan.StoredFile f : subtask.files()) {
            files.add(new String[] {stored.checkedPath(f).toString(), f.localName()});
        }
        return new Entries.Rocks(files, plan.state());
    }

    private void pause() throws IOException {
        if (plan.pauseFile() == null) return;
        Files.write(Path.of(plan.pauseFile() + ".paused-" + subtask.index()), new byte[0]);
        long deadline = System.nanoTime() + 300_000_000_000L;
        while (!Files.exists(Path.of(plan.pauseFile()))) {
            if (System.nanoTime() > deadline) throw new IOException("read paused for 300 s: " + plan.pauseFile()
                + " never appeared");
            try {
                Thread.sleep(50);
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
                throw new IOException("interrupted while paused", e);
            }
        }
    }

    @Override
    public void close() {
        try {
            if (entries != null) entries.close();
            batch.close();
        } finally {
            if (lease != null) lease.close();
        }
    }
}
