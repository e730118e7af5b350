package ckpt.reader;

import org.apache.spark.sql.connector.catalog.SupportsRead;
import org.apache.spark.sql.connector.catalog.Table;
import org.apache.spark.sql.connector.catalog.TableCapability;
import org.apache.spark.sql.connector.catalog.TableProvider;
import org.apache.spark.sql.connector.expressions.Transform;
import org.apache.spark.sql.connector.read.Batch;
import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReader;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.connector.read.Scan;
import org.apache.spark.sql.connector.read.ScanBuilder;
import org.apache.spark.sql.connector.read.SupportsPushDownRequiredColumns;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;
import org.apache.spark.sql.vectorized.ColumnarBatch;

import java.util.EnumSet;
import java.util.Map;
import java.util.Set;

/**
 * A Spark DataSource V2 over one state of a checkpoint: one input partition per
 * subtask, read inside the JVM by {@link SubtaskReader}. The Python library's
 * ``read_state`` plans the read (option {@code plan}: JSON of the checkpoint, the state's
 * codec and each subtask's files) and gives the schema; Spark prunes the columns a query
 * does not need. Not meant to be called by hand: ``read_state`` is the API.
 */
public final class StateSource implements TableProvider {
    @Override
    public StructType inferSchema(CaseInsensitiveStringMap options) {
        throw new IllegalArgumentException("the state reader takes its schema from read_state");
    }

    @Override
    public boolean supportsExternalMetadata() {
        return true;
    }

    @Override
    public Table getTable(StructType schema, Transform[] partitioning, Map<String, String> properties) {
        String plan = properties.get("plan");
        if (plan == null) throw new IllegalArgumentException("the state reader needs the plan option");
        return new StateTable(schema, plan);
    }

    private record StateTable(StructType schema, String plan) implements SupportsRead {
        @Override
        public String name() {
            return "checkpoint state";
        }

        @Override
        public Set<TableCapability> capabilities() {
            return EnumSet.of(TableCapability.BATCH_READ);
        }

        @Override
        public ScanBuilder newScanBuilder(CaseInsensitiveStringMap options) {
            return new Builder(schema, plan);
        }
    }

    private static final class Builder implements ScanBuilder, SupportsPushDownRequiredColumns {
        private StructType schema;
        private final String plan;

        Builder(StructType schema, String plan) {
            this.schema = schema;
            this.plan = plan;
        }

        @Override
        public void pruneColumns(StructType required) {
            schema = required;
        }

        @Override
        public Scan build() {
            return new StateScan(schema, ReadPlan.parse(plan), plan);
        }
    }

    private record StateScan(StructType readSchema, ReadPlan parsed, String plan) implements Scan, Batch {
        @Override
        public Batch toBatch() {
            return this;
        }

        @Override
        public String description() {
            return "state " + parsed.state() + " of checkpoint " + parsed.checkpointId() + " of job "
                + parsed.job();
        }

        @Override
        public InputPartition[] planInputPartitions() {
            InputPartition[] out = new InputPartition[parsed.subtasks()];
            for (int i = 0; i < out.length; i++) out[i] = new Subtask(plan, i);
            return out;
        }

        @Override
        public PartitionReaderFactory createReaderFactory() {
            return new Factory(readSchema);
        }
    }

    /** One subtask's partition: the plan (JSON) and the subtask's index. */
    record Subtask(String plan, int index) implements InputPartition {
    }

    private record Factory(StructType schema) implements PartitionReaderFactory {
        @Override
        public PartitionReader<InternalRow> createReader(InputPartition partition) {
            throw new UnsupportedOperationException("the state reader reads columnar batches");
        }

        @Override
        public boolean supportColumnarReads(InputPartition partition) {
            return true;
        }

        @Override
        public PartitionReader<ColumnarBatch> createColumnarReader(InputPartition partition) {
            Subtask s = (Subtask) partition;
            return new SubtaskReader(ReadPlan.parse(s.plan()), s.index(), schema);
        }
    }
}
