"""Deep-learning data through the real pieces: every column type Spark holds, from a DataFrame and from an RDD,
to ranks under ``mpiexec -n 2``, compared value by value with the record batches Spark itself hands to Python
(``mapInArrow``, the feeder's own source)."""

import datetime as dt
import json
import threading

import numpy as np
import pytest

from sparkbus.feeder import feed
from sparkbus.worker import BatchStream

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def typed_frame(spark, rows, partitions):
    """A DataFrame of every kind of column, each value a function of ``id``, with nulls in every column."""
    from pyspark.sql import functions as F

    i = F.col("id")
    tokens = F.expr("transform(array_repeat(0, cast(id % 5 as int)), (x, k) -> cast(id + k as int))")
    return spark.range(0, rows, numPartitions=partitions).select(
        i,
        F.when(i % 5 == 0, None).otherwise(i * 0.5).alias("score"),
        F.expr("unhex(repeat(lpad(hex(id % 256), 2, '0'), cast(id % 7 as int)))").alias("image"),
        F.when(i % 4 == 1, None).otherwise(F.concat(F.lit("é-"), i.cast("string"))).alias("label"),
        F.when(i % 6 == 2, None).otherwise(tokens).alias("tokens"),
        F.expr("transform(array_repeat(0, cast(id % 3 as int)), k -> IF(k = 1, NULL, cast(id * 10 + k as long)))")
        .alias("holes"),
        F.expr("array_repeat(array(cast(id as short), cast(id + 1 as short)), cast(id % 3 as int))").alias("nested"),
        F.when(i % 3 == 0, None).otherwise(F.struct(i.cast("int").alias("a"),
                                                    F.struct((i * 2.0).alias("x")).alias("pos"))).alias("meta"),
        F.expr("date_add(DATE'2024-01-01', cast(id % 400 as int))").alias("day"),
        F.expr("timestamp_seconds(id * 3600)").alias("at"),
        F.when(i % 7 == 3, None).otherwise(i % 2 == 0).alias("flag"),
        F.array(*[(i + j).cast("float") for j in range(3)]).alias("emb"))


def jsonable(value):
    if isinstance(value, (bytes, bytearray)):
        return {"hex": bytes(value).hex()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        value = value.astimezone(dt.timezone.utc).replace(tzinfo=None)
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def expected_by_id(df):
    """What Spark hands over, structs flattened to ``parent.child``, as the ranks record it: ``{id: {col: v}}``."""
    import pyarrow as pa

    from sparkbus.feeder.columns import flatten_record_batch

    def serialize(batches):
        for batch in batches:
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, batch.schema) as writer:
                writer.write_batch(batch)
            yield pa.record_batch({"ipc": pa.array([sink.getvalue().to_pybytes()], pa.binary())})

    flat = {}
    for row in df.mapInArrow(serialize, "ipc binary").collect():   # (DataFrame.toArrow fails on null structs)
        batch = pa.ipc.open_stream(bytes(row.ipc)).read_next_batch()
        for name, values in flatten_record_batch(batch).to_pydict().items():
            flat.setdefault(name, []).extend(values)
    return {row_id: {k: jsonable(v[n]) for k, v in flat.items()} for n, row_id in enumerate(flat["id"])}


def received_by_id(ranks, n, epoch=0):
    """Every row the ranks recorded (``--values``), ``{id: {col: value}}``, and the forms of their batches."""
    got, forms = {}, []
    for r in range(n):
        name = ranks.name or f"rank{r}"
        path = ranks.out / f"{name}-epoch{epoch}-values.json"
        if not path.exists():
            continue
        record = json.loads(path.read_text())
        values = record["values"]
        forms.extend(record["forms"])
        for k, row_id in enumerate(values.get("id", [])):
            assert row_id not in got, f"row {row_id} arrived twice"
            got[row_id] = {name: column[k] for name, column in values.items()}
    return got, forms


def test_every_column_type_from_a_dataframe_arrives_exactly(spark, start_broker_process, start_ranks):
    broker = start_broker_process()
    ranks = start_ranks(2, broker.ranks, "--stream", "typed", "--values", "--even", "no")
    df = typed_frame(spark, 2_000, 3)
    report = feed(df, broker.feed, stream="typed", batch_size=128, timeout=60)
    ranks.wait()
    got, forms = received_by_id(ranks, 2)
    expected = expected_by_id(df)
    assert report.rows == 2_000 and sorted(got) == list(range(2_000))
    assert set(got[0]) == {"id", "score", "image", "label", "tokens", "holes", "nested", "meta.a", "meta.pos.x",
                           "day", "at", "flag", "emb"}
    for row_id, row in expected.items():
        assert got[row_id] == row, row_id
    assert got[5]["at"] == "1970-01-01T05:00:00" and got[366]["day"] == "2025-01-01"    # UTC, datetime64
    # the forms a training loop meets: numpy for fixed shapes, masked where a batch holds nulls, ragged for the rest
    for form in forms:
        assert form["id"] == form["emb"] == form["day"] == form["at"] == "ndarray"
        assert form["score"] == form["flag"] == form["meta.a"] == "MaskedArray"     # every batch has a null
        assert form["image"] == form["label"] == form["tokens"] == form["nested"] == "RaggedColumn"


def test_rdd_rows_of_bytes_text_ragged_lists_none_and_dicts(spark, start_broker_process, start_ranks):
    broker = start_broker_process()
    ranks = start_ranks(0, broker.ranks, "--stream", "rows", "--values")
    rows = [{"id": i, "img": bytes([i % 256]) * (i % 5), "text": f"ü{i}" if i % 3 else None,
             "tokens": list(range(i % 4)) if i % 7 else None, "pos": {"x": i / 2, "name": f"p{i}"} if i % 2 else None}
            for i in range(600)]
    report = feed(spark.sparkContext.parallelize(rows, 3), broker.feed, stream="rows", batch_size=50, timeout=60)
    ranks.wait()
    got, _ = received_by_id(ranks, 1)
    assert report.rows == 600 and sorted(got) == list(range(600))
    for row in rows:
        i = row["id"]
        assert got[i]["img"] == {"hex": row["img"].hex()} and got[i]["text"] == row["text"]
        assert got[i]["tokens"] == row["tokens"]
        assert got[i]["pos.x"] == (i / 2 if i % 2 else None) and got[i]["pos.name"] == (f"p{i}" if i % 2 else None)


def test_declared_ragged_columns_keep_their_form_even_in_uniform_and_one_row_batches(spark, start_broker_process,
                                                                                  start_ranks):
    from pyspark.sql import functions as F

    broker = start_broker_process()
    ranks = start_ranks(0, broker.ranks, "--stream", "declared", "--values")
    df = spark.range(0, 201, numPartitions=1).select("id", F.array(F.col("id"), F.col("id")).alias("pair"))
    feed(df, broker.feed, stream="declared", batch_size=50, ragged=["pair"], timeout=60)
    ranks.wait()
    got, forms = received_by_id(ranks, 1)
    assert [f["pair"] for f in forms] == ["RaggedColumn"] * 5          # four of 50 rows, one of 1 row
    assert all(got[i]["pair"] == [i, i] for i in range(201))


@pytest.mark.parametrize("make, message", [
    (lambda F, df: df.select(F.expr("id * 1.5").alias("d")), r"'d' is decimal.*cast\('double'\).*id \* 1.5"),
    (lambda F, df: df.select(F.create_map(F.lit("k"), F.col("id")).alias("m")), "'m' is a map.*map_keys"),
    (lambda F, df: df.select(F.array(F.struct(F.col("id"))).alias("a")), "'a' holds arrays of structs"),
    (lambda F, df: df.select(F.lit(None).alias("n")), "'n' has no type"),
])
def test_columns_that_cannot_be_carried_are_refused_before_any_job(spark, start_broker_process, make, message):
    from pyspark.sql import functions as F

    broker = start_broker_process()
    df = make(F, spark.range(10))
    tracker = spark.sparkContext.statusTracker()
    jobs = sorted(tracker.getJobIdsForGroup())
    with pytest.raises(TypeError, match=message):
        feed(df, broker.feed, stream="refused", timeout=10)
    assert sorted(tracker.getJobIdsForGroup()) == jobs, "no Spark job ran"
    assert "refused" not in broker.stats()["streams"]


def test_options_that_name_no_suitable_column_are_refused_before_any_job(spark, start_broker_process):
    broker = start_broker_process()
    df = typed_frame(spark, 10, 1)
    with pytest.raises(TypeError, match="ragged names 'nope'"):
        feed(df, broker.feed, ragged=["nope"], timeout=10)
    with pytest.raises(TypeError, match="bucket_by names 'score', which is not a column of arrays"):
        feed(df, broker.feed, bucket_by="score", timeout=10)


def test_a_consumer_killed_inside_a_pack_of_ragged_batches_has_its_rest_redelivered(spark, start_broker_process,
                                                                                    killed_inside_a_pack):
    broker = start_broker_process("--heartbeat", "200ms", "--rejoin-grace", "1s")
    df = typed_frame(spark, 12_800, 2).select("id", "label", "tokens", "image")
    victim, survivor = killed_inside_a_pack(broker, "rpack", lambda: df, "--values")
    taken, _ = received_by_id(victim, 1)
    kept, _ = received_by_id(survivor, 1)
    expected = expected_by_id(df)
    assert len(taken) == 500 and sorted({*kept, *taken}) == list(range(12_800)), "every row"
    assert len(set(kept) & set(taken)) == 100, "the rest of the pack went again: the victim's fifth batch in it"
    assert all(kept[i] == expected[i] for i in kept) and all(taken[i] == expected[i] for i in taken)
    assert max(taken) - min(taken) < 64 * 100, "the victim's five batches lie in one pack"
    epoch = broker.stats()["streams"]["rpack"]["epochs"]["0"]
    assert epoch["redelivered"] % 64 == 60 and epoch["batches_in"] == 128, "the pack's unused 60 went again"


@pytest.mark.parametrize("steps, pack_bytes", [("mpi", 0), ("broker", 1 << 20)])
def test_even_ranks_even_out_ragged_batches_with_values_intact(spark, start_broker_process, start_ranks, steps,
                                                               pack_bytes):
    broker = start_broker_process()
    # 31 batches of 64 rows, rank 1 slow: rank 0 holds more at the end. Agreed over MPI, batches move between the
    # ranks in wire form (the pooled leftovers); granted by the broker, in packs, a rank gives back the unused tail
    # of a pack and the other gets it as a piece. The one left over is shared out by rows: 32 rows each.
    ranks = start_ranks(2, broker.ranks, "--stream", "evened", "--values", "--even", "yes", "--slow-rank", "1",
                        "--slow-seconds", "0.03", "--prefetch-bytes", "0", "--steps", steps)
    df = typed_frame(spark, 31 * 64, 1)
    feed(df, broker.feed, stream="evened", batch_size=64, pack_bytes=pack_bytes, timeout=60)
    summaries = ranks.wait()
    got, _ = received_by_id(ranks, 2)
    dropped = np.concatenate([ranks.epoch(r, 0)["dropped_id"] for r in range(2)])
    assert [s["epochs"][0]["batches"] for s in summaries] == [16, 16] and len(dropped) == 0
    assert [s["epochs"][0]["rows"] for s in summaries] == [15 * 64 + 32] * 2
    assert sorted(got) == list(range(31 * 64))
    expected = expected_by_id(df)
    assert all(got[i] == expected[i] for i in got)


def test_a_task_failing_midway_through_ragged_packs_is_retried_and_each_row_arrives_once(spark, start_broker_process,
                                                                                      start_ranks):
    def produce(part, ids):
        from pyspark import TaskContext

        attempt = TaskContext.get().attemptNumber()
        for n, i in enumerate(ids):
            if part == 1 and attempt == 0 and n == 9_500:     # well after its first pack of 64 batches went out
                raise RuntimeError("injected failure on the first attempt")
            yield {"id": i, "text": "ü" * (i % 9), "tokens": list(range(i % 6)) or None}

    broker = start_broker_process()
    ranks = start_ranks(0, broker.ranks, "--stream", "rretry", "--values")
    rdd = spark.sparkContext.parallelize(range(20_000), 2).mapPartitionsWithIndex(produce)
    report = feed(rdd, broker.feed, stream="rretry", batch_size=100, timeout=60)     # packs of small batches
    ranks.wait()
    got, _ = received_by_id(ranks, 1)
    assert report.rows == 20_000 and sorted(got) == list(range(20_000)), "each row once"
    assert all(got[i]["text"] == "ü" * (i % 9) and got[i]["tokens"] == (list(range(i % 6)) or None) for i in got)
    epoch = broker.stats()["streams"]["rretry"]["epochs"]["0"]
    assert epoch["duplicates"] >= 1 and epoch["diverged"] == [], "the retry's packs were recognised, not diverged"


def test_a_feed_asks_for_whole_batches_per_arrow_batch_and_restores_the_setting(spark, start_broker_process):
    from sparkbus.feeder.driver import ARROW_BATCH_CONF, arrow_rows_for

    assert [arrow_rows_for(n) for n in (1024, 128, 16, 20_000)] == [8192, 1024, 128, 20_000]
    broker = start_broker_process()

    def check(batches):          # runs in the job's tasks: Spark's record batches are the feed's 8 x 100 rows
        for batch in batches:
            if batch.num_rows not in (800, 600):          # 3,000 rows: 800, 800, 800, 600
                raise ValueError(f"a record batch of {batch.num_rows} rows")
            yield batch

    df = spark.range(0, 3_000, numPartitions=1).mapInArrow(check, "id long")
    spark.conf.set(ARROW_BATCH_CONF, "700")
    try:
        with BatchStream(broker.ranks, stream="aligned", timeout=30) as stream:
            got = []
            consumer = threading.Thread(target=lambda: got.extend(b["id"].copy() for b in stream.epoch()))
            consumer.start()
            feed(df, broker.feed, stream="aligned", batch_size=100, timeout=30)
            consumer.join(60)
        assert spark.conf.get(ARROW_BATCH_CONF) == "700", "the session's own setting is back"
    finally:
        spark.conf.unset(ARROW_BATCH_CONF)
    assert sorted(np.concatenate(got).tolist()) == list(range(3_000))


def test_token_budget_batches_from_spark_hold_the_budget_with_every_row_once(spark, start_broker_process):
    """``feed(..., batch_tokens=, tokens_by=)``: batches cut by the sum of a ragged column's lengths, a row longer
    than the budget alone; with ``bucket_by`` too, rows of similar length fill each budget."""
    from sparkbus.worker import RaggedColumn

    broker = start_broker_process()
    df = spark.range(0, 2_000, numPartitions=3).selectExpr(
        "id", "sequence(0, cast(pmod(id * 7919, 97) as int) + (case when id % 500 = 0 then 600 else 0 end)) as ids")
    for stream, extra in (("budget", {}), ("budget-bucketed", {"bucket_by": "ids"})):
        got: list[tuple[np.ndarray, np.ndarray]] = []

        def consume(rank, into):
            into.extend((b["id"].copy(), b["ids"].lengths().copy() if isinstance(b["ids"], RaggedColumn)
                         else np.full(len(b["id"]), b["ids"].shape[1])) for b in rank.epoch())

        with BatchStream(broker.ranks, stream=stream, timeout=30) as rank:
            consumer = threading.Thread(target=consume, args=(rank, got))
            consumer.start()
            feed(df, broker.feed, stream=stream, batch_size=10_000, ragged=["ids"], batch_tokens=512,
                 timeout=60, **extra)
            consumer.join(60)
        ids = np.concatenate([i for i, _ in got])
        np.testing.assert_array_equal(np.sort(ids), np.arange(2_000))
        tokens = [int(lengths.sum()) for _, lengths in got]
        assert all(t <= 512 or len(i) == 1 for t, (i, _) in zip(tokens, got)), "the budget holds"
        assert sum(1 for t in tokens if t > 512) == 4, "the four rows longer than the budget travel alone"
        assert sum(tokens) == sum(int(n) + 1 + (600 if i % 500 == 0 else 0)
                                  for i, n in ((i, (i * 7919) % 97) for i in range(2_000)))
        if extra:
            assert np.median(tokens) > 400, "bucketed rows fill their budgets"
