"""Declared schemas: documented columns, invariants that bind, metrics rows."""

import duckdb
import pyarrow as pa
import pytest

from ppoflow.tasks.storage.schemas import (
    INVARIANTS,
    ITERATION_TABLES,
    SCHEMAS,
    STAGES,
    TABLE_DOCS,
    TABLES,
    describe,
    empty_table,
    metrics_table,
)


def test_every_table_is_documented_and_has_invariants():
    assert set(TABLES) == set(TABLE_DOCS) == set(INVARIANTS) == set(SCHEMAS) | {"metrics"}
    # turns and filter_groups: the rollouts stage's other tables
    assert set(ITERATION_TABLES) == set(STAGES) | {"turns", "filter_groups"} <= set(TABLES)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_column_has_a_one_line_doc(name):
    for field in SCHEMAS[name]:
        doc = field.metadata[b"doc"].decode()
        assert doc and "\n" not in doc, f"{name}.{field.name}"
    assert "iter" not in SCHEMAS[name].names  # the folder supplies it


@pytest.mark.parametrize("name", TABLES)
def test_invariants_bind_against_the_declared_columns(name):
    table = empty_table(name)
    if name in ITERATION_TABLES:
        table = table.append_column("iter", pa.array([], pa.int32()))
    con = duckdb.connect()
    con.register(name, table)
    for sql in INVARIANTS[name]:
        assert con.execute(sql).fetchall() == [], sql


def test_declared_types_and_nullability():
    rollouts = SCHEMAS["rollouts"]
    assert rollouts.field("response_ids").type == pa.list_(pa.int32())
    assert rollouts.field("old_log_probs").type == pa.list_(pa.float32())
    assert rollouts.field("ref_log_probs").nullable and not rollouts.field("old_log_probs").nullable
    assert SCHEMAS["rewards"].field("components").type == pa.map_(pa.string(), pa.float64())
    assert SCHEMAS["advantages"].field("values").nullable
    messages = SCHEMAS["prompts"].field("prompt_messages").type
    assert messages.value_type == pa.struct([("role", pa.string()), ("content", pa.string())])
    assert SCHEMAS["actor_update"].field("kl_loss").nullable


def test_describe_is_a_markdown_table_of_every_column():
    text = describe("rollouts")
    assert text.startswith("### rollouts")
    assert "| `iter` | `int32` |" in text
    for field in SCHEMAS["rollouts"]:
        assert f"| `{field.name}` |" in text
    assert "Invariants" in text and "HAVING count(*) > 1" in text
    assert "verl" in describe("metrics")
    with pytest.raises(KeyError, match="unknown table 'nope'"):
        describe("nope")


def test_empty_tables_have_the_declared_columns():
    assert empty_table("rewards").schema.equals(SCHEMAS["rewards"])
    assert empty_table("rewards").num_rows == 0
    assert empty_table("metrics").column_names == ["step"]


def test_metrics_table_is_one_sorted_float_row():
    table = metrics_table({"critic/score/mean": 0.5, "actor/pg_clipfrac": 1, "timing/s": 2.0}, step=3)
    assert table.column_names == ["step", "actor/pg_clipfrac", "critic/score/mean", "timing/s"]
    assert table.schema.field("step").type == pa.int64()
    assert all(table.schema.field(c).type == pa.float64() for c in table.column_names[1:])
    assert table.to_pylist() == [
        {"step": 3, "actor/pg_clipfrac": 1.0, "critic/score/mean": 0.5, "timing/s": 2.0}
    ]


@pytest.mark.parametrize("bad", [{"step": 1.0}, {"iter": 1.0}, {"a/b": "x"}, {"a/b": True}, {"": 1.0}])
def test_metrics_table_rejects_reserved_names_and_non_numbers(bad):
    with pytest.raises(ValueError):
        metrics_table(bad, step=1)
