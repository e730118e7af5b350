package ckpt.reader;

import org.rocksdb.ColumnFamilyDescriptor;
import org.rocksdb.ColumnFamilyHandle;
import org.rocksdb.ColumnFamilyOptions;
import org.rocksdb.DBOptions;
import org.rocksdb.Options;
import org.rocksdb.RocksDB;
import org.rocksdb.RocksDBException;
import org.rocksdb.RocksIterator;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Comparator;
import java.util.List;

/**
 * The live entries of one column family of a subtask's instance, in key order: the
 * stored key (key-group prefix + key) and the value of each.
 *
 * <p>{@link Direct} reads the SST files themselves ({@link SstFile}): the newest version
 * of each user key across the files (highest sequence number), deletions left out.
 * {@link Rocks} opens the instance read-only through RocksDB (rocksdbjni) for what the
 * direct reader does not read: range tombstones, a non-empty WAL, ingested files (their
 * column family and sequence numbers live only in the MANIFEST).
 */
abstract class Entries implements AutoCloseable {
    byte[] key;
    int keyOffset;
    int keyLength;
    byte[] value;
    int valueOffset;
    int valueLength;

    /** Moves to the next live entry; false past the last. */
    abstract boolean next() throws IOException;

    @Override
    public abstract void close();

    static final class Direct extends Entries {
        private final SstFile.Cursor[] cursors;
        private final boolean[] loaded;
        private byte[] last = new byte[256];
        private int lastLength = -1;

        Direct(List<SstFile> files) throws IOException {
            cursors = new SstFile.Cursor[files.size()];
            loaded = new boolean[files.size()];
            for (int i = 0; i < cursors.length; i++) {
                cursors[i] = files.get(i).cursor();
                loaded[i] = advance(i);
            }
        }

        private boolean advance(int i) throws IOException {
            try {
                return cursors[i].next();
            } catch (SstFile.Unsupported e) {
                throw new IOException(e.getMessage(), e);
            }
        }

        @Override
        boolean next() throws IOException {
            while (true) {
                // the older versions of the entry returned last
                for (int i = 0; i < cursors.length; i++) {
                    while (loaded[i] && lastLength >= 0 && sameUserKey(cursors[i], last, lastLength)) {
                        loaded[i] = advance(i);
                    }
                }
                int best = -1;
                for (int i = 0; i < cursors.length; i++) {
                    if (loaded[i] && (best < 0 || newerFirst(cursors[i], cursors[best]) < 0)) best = i;
                }
                if (best < 0) return false;
                SstFile.Cursor c = cursors[best];
                int userLength = c.keyLength - 8;
                if (last.length < userLength) last = new byte[Math.max(userLength, last.length * 2)];
                System.arraycopy(c.key, 0, last, 0, userLength);
                lastLength = userLength;
                int type = c.type();
                if (type == 0 || type == 7) continue;  // deleted
                if (type != 1) throw new IOException("entry of type " + type + " in an SST file");
                key = c.key;
                keyLength = userLength;
                value = c.block;
                valueOffset = c.valueOffset;
                valueLength = c.valueLength;
                return true;
            }
        }

        private static boolean sameUserKey(SstFile.Cursor c, byte[] key, int length) {
            return Arrays.equals(c.key, 0, c.keyLength - 8, key, 0, length);
        }

        /** Internal-key order: user key ascending, then sequence number descending. */
        private static int newerFirst(SstFile.Cursor a, SstFile.Cursor b) {
            int byKey = Arrays.compareUnsigned(a.key, 0, a.keyLength - 8, b.key, 0, b.keyLength - 8);
            return byKey != 0 ? byKey : Long.compare(b.sequence(), a.sequence());
        }

        @Override
        public void close() {
        }
    }

    static final class Rocks extends Entries {
        private final Path dir;
        private final List<ColumnFamilyHandle> handles = new ArrayList<>();
        private final List<ColumnFamilyOptions> familyOptions = new ArrayList<>();
        private final RocksDB db;
        private final RocksIterator iterator;
        private boolean started;
        private boolean done;  // RocksDB must not be asked for the next of an invalid iterator

        /** ``files``: (path, name in the instance) of every file of the subtask. */
        Rocks(List<String[]> files, String columnFamily) throws IOException {
            RocksDB.loadLibrary();
            dir = Files.createTempDirectory("ckpt-read-");
            RocksDB opened = null;
            try {
                for (String[] f : files) Files.createSymbolicLink(dir.resolve(f[1]), Path.of(f[0]));
                List<byte[]> names;
                try (Options options = new Options()) {
                    names = RocksDB.listColumnFamilies(options, dir.toString());
                }
                List<ColumnFamilyDescriptor> descriptors = new ArrayList<>();
                for (byte[] n : names) {
                    ColumnFamilyOptions o = new ColumnFamilyOptions();
                    familyOptions.add(o);
                    descriptors.add(new ColumnFamilyDescriptor(n, o));
                }
                try (DBOptions options = new DBOptions()) {
                    opened = RocksDB.openReadOnly(options, dir.toString(), descriptors, handles);
                }
                ColumnFamilyHandle handle = null;
                for (int i = 0; i < names.size(); i++) {
                    if (new String(names.get(i), StandardCharsets.UTF_8).equals(columnFamily)) handle = handles.get(i);
                }
                db = opened;
                // a state with no entries in this subtask may have no column family here
                iterator = handle == null ? null : db.newIterator(handle);
            } catch (RocksDBException | IOException | RuntimeException e) {
                for (ColumnFamilyHandle h : handles) h.close();
                if (opened != null) opened.close();
                for (ColumnFamilyOptions o : familyOptions) o.close();
                removeTree(dir);
                throw e instanceof IOException io ? io : new IOException(e.getMessage(), e);
            }
        }

        @Override
        boolean next() throws IOException {
            if (iterator == null || done) return false;
            if (started) iterator.next(); else iterator.seekToFirst();
            started = true;
            if (!iterator.isValid()) {
                done = true;
                try {
                    iterator.status();  // a read error ends the iteration too: raise it
                } catch (RocksDBException e) {
                    throw new IOException(e.getMessage(), e);
                }
                return false;
            }
            key = iterator.key();
            keyLength = key.length;
            value = iterator.value();
            valueOffset = 0;
            valueLength = value.length;
            return true;
        }

        @Override
        public void close() {
            if (iterator != null) iterator.close();
            for (ColumnFamilyHandle h : handles) h.close();
            db.close();
            for (ColumnFamilyOptions o : familyOptions) o.close();
            removeTree(dir);
        }

        private static void removeTree(Path dir) {
            try (var walk = Files.walk(dir)) {
                walk.sorted(Comparator.reverseOrder()).forEach(p -> p.toFile().delete());
            } catch (IOException ignored) {
                // a temp folder left behind is the only cost
            }
        }
    }
}
