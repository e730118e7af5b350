package ckpt.reader;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;

import java.io.IOException;
import java.lang.management.ManagementFactory;
import java.net.InetAddress;
import java.nio.file.AtomicMoveNotSupportedException;
import java.nio.file.Files;
import java.nio.file.LinkOption;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import java.time.OffsetDateTime;
import java.time.ZoneOffset;
import java.time.format.DateTimeFormatter;
import java.util.UUID;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;

/**
 * A hold lease on one checkpoint, written as the Python library writes one
 * (statebackend.checkpoint.leases): ``leases/hold-<hex>.json`` created exclusively
 * (a link to a complete temp file: readers never see half a lease), renewed every
 * heartbeat by an atomic replace after re-reading it (another token or no file: lost,
 * and the read fails), deleted at the end if still ours. While it is live, retention
 * keeps the checkpoint and GC keeps every file it references.
 */
final class HoldLease implements AutoCloseable {
    private static final ObjectMapper JSON = new ObjectMapper();
    private static final DateTimeFormatter TIME =
        DateTimeFormatter.ofPattern("yyyy-MM-dd'T'HH:mm:ss.SSSSSSxxx");

    private final Path file;
    private final ObjectNode record;
    private final double ttlSeconds;
    private final ScheduledExecutorService beat;
    private volatile String lost;  // why the lease was lost; it is then no longer renewed

    HoldLease(Path leasesDir, String purpose, long checkpointId, double ttlSeconds,
              double heartbeatSeconds) throws IOException {
        this.ttlSeconds = ttlSeconds;
        String name = "hold-" + UUID.randomUUID().toString().replace("-", "");
        file = leasesDir.resolve(name + ".json");
        OffsetDateTime now = OffsetDateTime.now(ZoneOffset.UTC);
        record = JSON.createObjectNode();
        record.put("format_version", 1);
        record.put("name", name);
        record.put("holder", holder());
        record.put("purpose", purpose);
        record.putArray("checkpoint_ids").add(checkpointId);
        record.put("expires_at", TIME.format(now.plusNanos((long) (ttlSeconds * 1e9))));
        record.put("created_at", TIME.format(now));
        record.put("token", UUID.randomUUID().toString().replace("-", ""));
        Files.createDirectories(leasesDir);
        Path tmp = temp();
        try {
            Files.createLink(file, tmp);  // fails if the name exists: exclusive
        } finally {
            Files.deleteIfExists(tmp);
        }
        long period = Math.max(50L, (long) (heartbeatSeconds * 1000));
        beat = Executors.newSingleThreadScheduledExecutor(r -> {
            Thread t = new Thread(r, "ckpt-lease-" + name);
            t.setDaemon(true);
            return t;
        });
        beat.scheduleAtFixedRate(this::renew, period, period, TimeUnit.MILLISECONDS);
    }

    private synchronized void renew() {
        if (lost != null) return;
        try {
            JsonNode current = Files.exists(file, LinkOption.NOFOLLOW_LINKS)
                ? JSON.readTree(file.toFile()) : null;
            if (current == null) {
                lost = "its file was removed";
            } else if (!record.get("token").asText().equals(current.path("token").asText())) {
                lost = "taken over by " + current.path("purpose").asText();
            } else if (OffsetDateTime.parse(record.get("expires_at").asText())
                           .isBefore(OffsetDateTime.now(ZoneOffset.UTC))) {
                lost = "not renewed before it expired at " + record.get("expires_at").asText();
            }
            if (lost != null) return;
            record.put("expires_at", TIME.format(OffsetDateTime.now(ZoneOffset.UTC)
                .plusNanos((long) (ttlSeconds * 1e9))));
            Path tmp = temp();
            try {
                Files.move(tmp, file, StandardCopyOption.ATOMIC_MOVE, StandardCopyOption.REPLACE_EXISTING);
            } catch (AtomicMoveNotSupportedException e) {
                Files.deleteIfExists(tmp);
                throw e;
            }
        } catch (IOException | RuntimeException e) {
            // storage briefly unreachable: retried at the next beat, as the Python holder does
        }
    }

    private Path temp() throws IOException {
        Path tmp = file.resolveSibling("." + file.getFileName() + "." + UUID.randomUUID().toString()
            .replace("-", "") + ".tmp");
        Files.write(tmp, JSON.writeValueAsBytes(record));
        return tmp;
    }

    private static String holder() {
        String host;
        try {
            host = InetAddress.getLocalHost().getHostName();
        } catch (IOException e) {
            host = "localhost";
        }
        return host + ":" + ManagementFactory.getRuntimeMXBean().getPid();
    }

    @Override
    public synchronized void close() {
        beat.shutdownNow();
        try {
            JsonNode current = JSON.readTree(file.toFile());
            if (record.get("token").asText().equals(current.path("token").asText())) {
                Files.deleteIfExists(file);
            }
        } catch (IOException ignored) {
            // gone already, or unreadable: it expires by itself
        }
    }
}
