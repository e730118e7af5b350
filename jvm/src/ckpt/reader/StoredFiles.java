package ckpt.reader;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.LinkOption;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.zip.CRC32;
import java.util.zip.CRC32C;
import java.util.zip.Checksum;

/**
 * Where a subtask's stored files are read from, and the checks before any byte is used:
 * the executor's local copy (the folder a job run on this host left: a RocksDB local
 * snapshot, or the memory backend's files) when it has the recorded size, then storage;
 * a symbolic link, a missing file or a wrong size in storage is refused, and a copy
 * whose CRC is not the recorded one is passed over for the next (none left: refused,
 * naming the file).
 */
final class StoredFiles {
    private final String localFolder;

    StoredFiles(String localFolder) {
        this.localFolder = localFolder;
    }

    /** The places to read ``f`` from, in order (at least one: else it throws). */
    List<Path> candidates(ReadPlan.StoredFile f) throws IOException {
        List<Path> out = new ArrayList<>();
        if (localFolder != null) {
            Path local = Path.of(localFolder, f.localName());
            if (Files.isRegularFile(local, LinkOption.NOFOLLOW_LINKS) && Files.size(local) == f.size()) {
                out.add(local);
            }
        }
        Path path = Path.of(f.path());
        String refused = null;
        if (Files.isSymbolicLink(path)) {
            refused = "refused " + path + ": a symbolic link; storage holds regular files only";
        } else if (!Files.isRegularFile(path, LinkOption.NOFOLLOW_LINKS)) {
            refused = path + " is missing: the checkpoint lost a file (`ckpt validate --full`)";
        } else if (Files.size(path) != f.size()) {
            refused = path + ": " + Files.size(path) + " bytes, metadata records " + f.size() + " bytes";
        } else {
            out.add(path);
        }
        if (out.isEmpty()) throw new IOException(refused);
        return out;
    }

    /** ``f``'s bytes from the first place whose CRC is the recorded one. */
    byte[] readChecked(ReadPlan.StoredFile f) throws IOException {
        IOException last = null;
        for (Path path : candidates(f)) {
            byte[] data = Files.readAllBytes(path);
            last = mismatch(f, path, crc(data, f.checksum()));
            if (last == null) return data;
        }
        throw last;
    }

    /** The first place of ``f`` whose bytes have the recorded CRC. */
    Path checkedPath(ReadPlan.StoredFile f) throws IOException {
        IOException last = null;
        for (Path path : candidates(f)) {
            last = mismatch(f, path, crc(Files.readAllBytes(path), f.checksum()));
            if (last == null) return path;
        }
        throw last;
    }

    /** The CRC of ``data`` by the algorithm ``checksum`` (``crc32c:...``, ``crc32:...``) names. */
    static long crc(byte[] data, String checksum) {
        Checksum crc = checksum.startsWith("crc32c:") ? new CRC32C() : new CRC32();
        crc.update(data, 0, data.length);
        return crc.getValue();
    }

    /** Null when ``crc`` of ``path`` is the CRC recorded for ``f``, else the error to raise. */
    static IOException mismatch(ReadPlan.StoredFile f, Path path, long crc) {
        String recorded = f.checksum();
        String found = recorded.substring(0, Math.max(0, recorded.indexOf(':'))) + ":" + String.format("%08x", crc);
        return found.equals(recorded) ? null : new IOException(path + ": " + f.size() + " bytes with " + found
            + ", metadata records " + recorded + " (a damaged or replaced file)");
    }
}
