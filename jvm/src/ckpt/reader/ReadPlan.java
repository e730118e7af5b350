package ckpt.reader;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.util.ArrayList;
import java.util.List;

/**
 * What ``read_state`` planned (statebackend.spark.jvm_reader builds the JSON, format 1):
 * the checkpoint (and the digest of its ``_metadata``), the state and its codec, and
 * each subtask's key-group range and files with their recorded sizes and checksums, and
 * the folder where a job run on this host left that subtask's local snapshot, if any.
 * ``backend``: ``rocksdb`` or ``memory`` (its key-group files); ``direct`` (default
 * true): false reads every RocksDB subtask through RocksDB (a test hook).
 */
record ReadPlan(String job, String metadataPath, String leasesDir, long checkpointId,
                String recordDigest, String state, String codec, List<Field> fields,
                boolean ttl, Long now, double leaseTtlSeconds, double leaseHeartbeatSeconds,
                String pauseFile, int batchRows, boolean memory, boolean direct,
                List<SubtaskFiles> subtaskFiles) {

    static final int FORMAT = 1;

    record Field(String name, String type) {
    }

    /** ``keyGroups``: a memory-backend file's key groups this subtask reads from it. */
    record StoredFile(String path, String localName, long size, String checksum, List<Integer> keyGroups) {
    }

    record SubtaskFiles(int index, int keyGroupStart, int keyGroupEnd, String localSnapshot,
                        List<StoredFile> files) {
    }

    int subtasks() {
        return subtaskFiles.size();
    }

    static ReadPlan parse(String json) {
        JsonNode n;
        try {
            n = new ObjectMapper().readTree(json);
        } catch (IOException e) {
            throw new UncheckedIOException("state reader plan is not JSON: " + e.getMessage(), e);
        }
        if (n.path("format").asInt() != FORMAT) {
            throw new IllegalArgumentException("state reader plan of format " + n.path("format")
                + "; this reader reads format " + FORMAT + " (rebuild the jar with the library)");
        }
        List<Field> fields = new ArrayList<>();
        for (JsonNode f : n.path("fields")) fields.add(new Field(f.get(0).asText(), f.get(1).asText()));
        List<SubtaskFiles> subtasks = new ArrayList<>();
        for (JsonNode s : n.path("subtasks")) {
            List<StoredFile> files = new ArrayList<>();
            for (JsonNode f : s.path("files")) {
                List<Integer> keyGroups = new ArrayList<>();
                for (JsonNode kg : f.path("key_groups")) keyGroups.add(kg.asInt());
                files.add(new StoredFile(f.get("path").asText(), f.get("local_name").asText(),
                                         f.get("size").asLong(), f.get("checksum").asText(), keyGroups));
            }
            JsonNode local = s.path("local_snapshot");
            subtasks.add(new SubtaskFiles(s.get("index").asInt(), s.get("key_group_start").asInt(),
                                          s.get("key_group_end").asInt(),
                                          local.isTextual() ? local.asText() : null, files));
        }
        JsonNode now = n.path("now");
        JsonNode pause = n.path("pause_file");
        return new ReadPlan(n.get("job").asText(), n.get("metadata_path").asText(),
                            n.get("leases_dir").asText(), n.get("checkpoint_id").asLong(),
                            n.get("record_digest").asText(), n.get("state").asText(),
                            n.get("codec").asText(), fields, n.path("ttl").asBoolean(),
                            now.isNull() || now.isMissingNode() ? null : now.asLong(),
                            n.get("lease_ttl_seconds").asDouble(),
                            n.get("lease_heartbeat_seconds").asDouble(),
                            pause.isNull() || pause.isMissingNode() ? null : pause.asText(),
                            n.get("batch_rows").asInt(), "memory".equals(n.path("backend").asText()),
                            n.path("direct").asBoolean(true), subtasks);
    }
}
