"""The schema checks of a feed: which DataFrame columns sparkbus carries, decided from the schema before any job.

:func:`prepare_dataframe` selects the columns to feed (ML vectors turned into arrays) and refuses, with a
``TypeError`` that names the column and says what to do, every type the wire cannot carry exactly, and ``ragged`` or
``bucket_by`` names that are not columns of arrays, binary or strings. It needs pyspark, imported when called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def prepare_dataframe(df: Any, columns: Sequence[str] | None = None, ragged: Sequence[str] = (),
                      bucket_by: str | None = None, tokens_by: str | None = None) -> Any:
    """Select the columns to feed, turning ML vectors into arrays; refuse what sparkbus cannot carry, by name.

    Everything is decided from the schema, before any Spark job runs.

    Raises:
        TypeError: a column whose type sparkbus cannot carry (with what to do about it), a name that is not a
            column, or a ``ragged``/``bucket_by`` column that is not an array, binary or string column.
    """
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT

    names = list(columns) if columns is not None else df.columns
    fields = {f.name: f.dataType for f in df.schema.fields}
    selected = []
    for name in names:
        if name not in fields:
            raise TypeError(f"column {name!r} is not in the DataFrame (columns: {', '.join(df.columns)})")
        kind = fields[name]
        if isinstance(kind, VectorUDT):
            selected.append(vector_to_array(df[name]).alias(name))
            continue
        check_spark_type(name, kind)
        selected.append(df[name])
    if not selected:
        raise TypeError("no columns to feed")
    flat = flat_spark_fields(names, fields)
    for option, wanted in (("ragged", list(ragged)), ("bucket_by", [bucket_by] if bucket_by else []),
                           ("batch_tokens' tokens_by", [tokens_by] if tokens_by else [])):
        for name in wanted:
            if name not in flat:
                raise TypeError(f"{option} names {name!r}, which is not a fed column (fed: {', '.join(flat)})")
            if not flat[name]:
                raise TypeError(f"{option} names {name!r}, which is not a column of arrays, binary or strings")
    return df.select(*selected)


def check_spark_type(name: str, kind: Any, inside: str = "") -> None:
    """Raise TypeError, naming the column and what to do, for a Spark type sparkbus cannot carry exactly."""
    from pyspark.sql import types as T

    carried = (T.BooleanType, T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.FloatType, T.DoubleType,
               T.BinaryType, T.StringType, T.DateType, T.TimestampType, T.TimestampNTZType, T.DayTimeIntervalType)
    if isinstance(kind, carried):
        return
    if isinstance(kind, T.ArrayType):
        return check_spark_type(name, kind.elementType, "an array of ")
    if isinstance(kind, T.StructType):
        if inside:
            raise TypeError(f"column {name!r} holds arrays of structs ({kind.simpleString()}), which sparkbus "
                            f"cannot carry: select each field as an array of its own (e.g. "
                            f"transform({name}, x -> x.field)) or use to_json")
        for field in kind.fields:
            check_spark_type(f"{name}.{field.name}", field.dataType)
        return
    if isinstance(kind, T.DecimalType):
        raise TypeError(f"column {name!r} is {inside}{kind.simpleString()}, which sparkbus cannot carry exactly: "
                        f"cast it in Spark, e.g. df.withColumn({name!r}, df[{name!r}].cast('double')) (SQL "
                        f"literals such as id * 1.5 make decimals)")
    if isinstance(kind, T.MapType):
        raise TypeError(f"column {name!r} is {inside}a map ({kind.simpleString()}), which sparkbus cannot carry: "
                        f"send map_keys({name}) and map_values({name}) as two array columns, or to_json({name})")
    if isinstance(kind, T.NullType):
        raise TypeError(f"column {name!r} has no type (only nulls, e.g. lit(None)): cast it to the type its "
                        f"values would have")
    raise TypeError(f"column {name!r} is {inside}{kind.simpleString()}, which sparkbus cannot carry exactly "
                    f"(numbers, booleans, binary, strings, dates, timestamps, arrays and structs of those, "
                    f"ML vectors)")


def flat_spark_fields(names: Sequence[str], fields: dict[str, Any]) -> dict[str, bool]:
    """The columns as the ranks will see them (structs flattened to ``parent.child``), each with whether it is
    a column of arrays, binary or strings (which ``ragged`` and ``bucket_by`` may name)."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    flat: dict[str, bool] = {}

    def add(name: str, kind: Any) -> None:
        if isinstance(kind, T.StructType):
            for field in kind.fields:
                add(f"{name}.{field.name}", field.dataType)
        else:
            flat[name] = isinstance(kind, (T.ArrayType, T.BinaryType, T.StringType, VectorUDT))

    for name in names:
        add(name, fields[name])
    return flat


__all__ = ["prepare_dataframe", "check_spark_type", "flat_spark_fields"]
