package ckpt.reader;

import io.airlift.compress.snappy.SnappyDecompressor;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.channels.FileChannel;
import java.nio.charset.StandardCharsets;
import java.util.HashMap;
import java.util.Map;

/**
 * One RocksDB block-based SST file, read from its bytes without RocksDB: the footer
 * (format versions 2 to 6), the metaindex, the properties and the index, then every
 * entry of every data block in order.
 *
 * <p>Only what our instances write is read (rocks_options in the Python library):
 * blocks uncompressed or Snappy-compressed, a binary-search index and binary-search
 * data blocks. Anything else (another compression, a hash index, a range tombstone)
 * raises {@link Unsupported}, and the caller reads the instance through RocksDB
 * instead. Block checksums are not verified here: the caller checks each whole file
 * against the CRC recorded in the checkpoint's metadata first ({@link StoredFiles}).
 */
final class SstFile {
    static final long BLOCK_BASED_MAGIC = 0x88e241b785f4cff7L;
    static final int TRAILER = 5;           // compression type byte + 4-byte checksum
    static final int FOOTER = 53;           // every format version >= 1
    static final byte[] EXTENDED_MAGIC = {0x3e, 0x00, 0x7a, 0x00};

    /** A reason this reader cannot read a file; RocksDB itself then reads it. */
    static final class Unsupported extends Exception {
        private static final long serialVersionUID = 1L;

        Unsupported(String why) { super(why); }
    }

    final String name;
    private final FileChannel channel;
    private final long size;
    private byte[] data;                     // the whole file, once read by load()
    final Map<String, byte[]> properties;
    private final long[] dataBlocks;         // offset, size pairs in key order
    private final SnappyDecompressor snappy = new SnappyDecompressor();

    /**
     * Reads the footer, metaindex, properties and index blocks (a few small reads);
     * the data blocks are read by {@link #load()}. The caller closes {@code channel}.
     */
    SstFile(String name, FileChannel channel) throws IOException, Unsupported {
        this.name = name;
        this.channel = channel;
        this.size = channel.size();
        if (size < FOOTER) throw new Unsupported(name + " is too short to be an SST file");
        if (size > Integer.MAX_VALUE - 64) throw new Unsupported(name + " is over 2 GiB");
        byte[] tail = read(size - FOOTER, FOOTER);
        if (le64(tail, FOOTER - 8) != BLOCK_BASED_MAGIC) {
            throw new Unsupported(name + " is not a block-based SST file");
        }
        int version = (int) le32(tail, FOOTER - 12);
        long footer = size - FOOTER;
        long[] metaindex = new long[2];
        long[] index = null;
        if (version >= 6) {
            for (int i = 0; i < 4; i++) {
                if (tail[1 + i] != EXTENDED_MAGIC[i]) throw new Unsupported(name + ": bad extended magic number");
            }
            long metaSize = le32(tail, 13);
            metaindex[0] = footer - TRAILER - metaSize;
            metaindex[1] = metaSize;
        } else if (version >= 2) {
            int[] at = {1};
            metaindex[0] = varint64(tail, at);
            metaindex[1] = varint64(tail, at);
            index = new long[] {varint64(tail, at), varint64(tail, at)};
        } else {
            throw new Unsupported(name + ": format version " + version);
        }
        Map<String, byte[]> meta = namedEntries(block(metaindex[0], metaindex[1]));
        if (meta.containsKey("rocksdb.range_del")) {
            throw new Unsupported(name + " holds range tombstones");
        }
        byte[] propertiesHandle = meta.get("rocksdb.properties");
        if (propertiesHandle == null) throw new Unsupported(name + " has no properties block");
        int[] at = {0};
        properties = namedEntries(block(varint64(propertiesHandle, at), varint64(propertiesHandle, at)));
        if (index == null) {
            byte[] handle = meta.get("rocksdb.index");
            if (handle == null) throw new Unsupported(name + " has no index block");
            at[0] = 0;
            index = new long[] {varint64(handle, at), varint64(handle, at)};
        }
        byte[] indexType = properties.get("rocksdb.block.based.table.index.type");
        if (indexType != null && indexType.length == 4 && le32(indexType, 0) != 0) {
            throw new Unsupported(name + ": index type " + le32(indexType, 0));
        }
        if (propertyNumber("rocksdb.num.range-deletions") != 0) {
            throw new Unsupported(name + " holds range deletions");
        }
        dataBlocks = indexHandles(block(index[0], index[1]),
                                  propertyNumber("rocksdb.index.value.is.delta.encoded") == 1);
        for (int b = 0; b < dataBlocks.length; b += 2) {
            if (dataBlocks[b] < 0 || dataBlocks[b] + dataBlocks[b + 1] + TRAILER > size) {
                throw new Unsupported(name + ": a data block outside the file");
            }
        }
    }

    /**
     * Reads the whole file (the caller checks its CRC before reading an entry) and each
     * data block's compression, so nothing is refused half-way through a scan.
     */
    byte[] load() throws IOException, Unsupported {
        data = read(0, (int) size);
        for (int b = 0; b < dataBlocks.length; b += 2) {
            int compression = data[(int) (dataBlocks[b] + dataBlocks[b + 1])] & 0xff;
            if (compression > 1) throw new Unsupported(name + ": a data block of compression type " + compression);
        }
        return data;
    }

    private byte[] read(long offset, int length) throws IOException {
        byte[] out = new byte[length];
        ByteBuffer buf = ByteBuffer.wrap(out);
        while (buf.hasRemaining()) {
            if (channel.read(buf, offset + buf.position()) < 0) throw new IOException(name + ": truncated");
        }
        return out;
    }

    /** The column family the file belongs to. */
    String columnFamily() {
        byte[] v = properties.get("rocksdb.column.family.name");
        return v == null ? null : new String(v, StandardCharsets.UTF_8);
    }

    /** Whether the file was ingested (its entries' sequence numbers live in the MANIFEST). */
    boolean external() {
        return properties.containsKey("rocksdb.external_sst_file.version");
    }

    long propertyNumber(String property) {
        byte[] v = properties.get(property);
        return v == null ? 0 : varint64(v, new int[] {0});
    }

    /** A cursor over every entry of every data block, in internal-key order. */
    Cursor cursor() {
        if (data == null) throw new IllegalStateException(name + ": load() it first");
        return new Cursor();
    }

    /**
     * Entry by entry: after {@code next()} returns true, {@code key[0, keyLength)} is the
     * internal key (user key + 8 trailer bytes) and the value is
     * {@code block[valueOffset, valueOffset + valueLength)}.
     */
    final class Cursor {
        byte[] key = new byte[256];
        int keyLength;
        byte[] block;
        int valueOffset;
        int valueLength;
        private int nextBlock;
        private int p;
        private int limit;

        boolean next() throws Unsupported {
            while (p >= limit) {
                if (nextBlock >= dataBlocks.length) return false;
                Block b = block(dataBlocks[nextBlock], dataBlocks[nextBlock + 1]);
                nextBlock += 2;
                block = b.bytes;
                p = b.start;
                limit = b.entriesEnd();
                keyLength = 0;
            }
            byte[] buf = block;
            int shared, unshared;
            if ((buf[p] | buf[p + 1] | buf[p + 2]) >= 0) {  // the three lengths fit a byte each
                shared = buf[p];
                unshared = buf[p + 1];
                valueLength = buf[p + 2];
                p += 3;
            } else {
                int[] at = {p};
                shared = varint32(buf, at);
                unshared = varint32(buf, at);
                valueLength = varint32(buf, at);
                p = at[0];
            }
            if (shared > keyLength || unshared < 0 || valueLength < 0
                    || p + unshared + valueLength > limit) {
                throw new Unsupported(name + ": corrupt data block entry");
            }
            int length = shared + unshared;
            if (length > key.length) key = java.util.Arrays.copyOf(key, Math.max(length, key.length * 2));
            System.arraycopy(buf, p, key, shared, unshared);
            keyLength = length;
            p += unshared;
            valueOffset = p;
            p += valueLength;
            if (keyLength < 8) throw new Unsupported(name + ": internal key shorter than its trailer");
            return true;
        }

        /** The entry's type byte (1 a value, 0 or 7 a deletion). */
        int type() {
            return key[keyLength - 8] & 0xff;
        }

        long sequence() {
            return le64(key, keyLength - 8) >>> 8;
        }
    }

    /** A block's bytes (decompressed when the trailer says so). */
    private Block block(long offset, long length) throws Unsupported {
        if (offset < 0 || length < 4 || offset + length + TRAILER > size) {
            throw new Unsupported(name + ": block handle outside the file");
        }
        byte[] data;
        int off, n = (int) length;
        if (this.data != null) {
            data = this.data;
            off = (int) offset;
        } else {
            try {
                data = read(offset, n + TRAILER);
            } catch (IOException e) {
                throw new Unsupported(name + ": " + e.getMessage());
            }
            off = 0;
        }
        byte compression = data[off + n];
        if (compression == 0) return new Block(data, off, off + n, name);
        if (compression != 1) throw new Unsupported(name + ": compression type " + compression);
        byte[] out = new byte[SnappyDecompressor.getUncompressedLength(data, off)];
        int written = snappy.decompress(data, off, n, out, 0, out.length);
        return new Block(out, 0, written, name);
    }

    private static Map<String, byte[]> namedEntries(Block block) throws Unsupported {
        Map<String, byte[]> out = new HashMap<>();
        byte[] buf = block.bytes;
        int p = block.start;
        int limit = block.entriesEnd();
        byte[] key = new byte[64];
        int keyLength = 0;
        while (p < limit) {
            int[] at = {p};
            int shared = varint32(buf, at), unshared = varint32(buf, at), valueLength = varint32(buf, at);
            p = at[0];
            keyLength = shared + unshared;
            if (keyLength > key.length) key = java.util.Arrays.copyOf(key, keyLength * 2);
            System.arraycopy(buf, p, key, shared, unshared);
            p += unshared;
            out.put(new String(key, 0, keyLength, StandardCharsets.UTF_8),
                    java.util.Arrays.copyOfRange(buf, p, p + valueLength));
            p += valueLength;
        }
        return out;
    }

    /** The (offset, size) of each data block from the index block. */
    private static long[] indexHandles(Block block, boolean deltaEncoded) throws Unsupported {
        byte[] buf = block.bytes;
        int restarts = block.restarts();
        int restartArray = block.entriesEnd();
        java.util.Set<Integer> restartPoints = new java.util.HashSet<>();
        for (int i = 0; i < restarts; i++) restartPoints.add((int) le32(buf, restartArray + 4 * i));
        long[] out = new long[16];
        int count = 0;
        int p = block.start;
        long previousOffset = 0, previousSize = 0;
        while (p < restartArray) {
            boolean restart = restartPoints.contains(p - block.start);
            int[] at = {p};
            varint32(buf, at);                           // shared
            int unshared = varint32(buf, at);
            if (!deltaEncoded) varint32(buf, at);        // value length
            at[0] += unshared;
            long offset, size;
            if (!deltaEncoded || restart) {
                offset = varint64(buf, at);
                size = varint64(buf, at);
            } else {
                long zigzag = varint64(buf, at);
                offset = previousOffset + previousSize + TRAILER;
                size = previousSize + ((zigzag >>> 1) ^ -(zigzag & 1));
            }
            p = at[0];
            if (count + 2 > out.length) out = java.util.Arrays.copyOf(out, out.length * 2);
            out[count++] = offset;
            out[count++] = size;
            previousOffset = offset;
            previousSize = size;
        }
        return java.util.Arrays.copyOf(out, count);
    }

    /** A block: entries, then the restart array, then the restart count. */
    private record Block(byte[] bytes, int start, int end, String file) {
        int restarts() throws Unsupported {
            long footer = le32(bytes, end - 4);
            if ((footer & 0x80000000L) != 0) throw new Unsupported(file + ": data block hash index");
            return (int) footer;
        }

        int entriesEnd() throws Unsupported {
            int at = end - 4 - 4 * restarts();
            if (at < start) throw new Unsupported(file + ": corrupt block");
            return at;
        }
    }

    static long le32(byte[] b, int p) {
        return (b[p] & 0xffL) | (b[p + 1] & 0xffL) << 8 | (b[p + 2] & 0xffL) << 16 | (b[p + 3] & 0xffL) << 24;
    }

    static long le64(byte[] b, int p) {
        return le32(b, p) | le32(b, p + 4) << 32;
    }

    static long be64(byte[] b, int p) {
        long out = 0;
        for (int i = 0; i < 8; i++) out = out << 8 | (b[p + i] & 0xffL);
        return out;
    }

    static int varint32(byte[] b, int[] at) {
        return (int) varint64(b, at);
    }

    static long varint64(byte[] b, int[] at) {
        long result = 0;
        int p = at[0];
        for (int shift = 0; shift <= 63; shift += 7) {
            byte x = b[p++];
            result |= (long) (x & 0x7f) << shift;
            if (x >= 0) break;
        }
        at[0] = p;
        return result;
    }
}
