import pytest

from sparkbus.broker.config import from_env, parse_duration, parse_size


@pytest.mark.parametrize("text, value", [("1GiB", 1 << 30), ("512MiB", 512 << 20), ("64k", 64000),
                                          ("1024", 1024), (" 1.5 MiB", 3 << 19), (2048, 2048)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text, value", [("30s", 30.0), ("250ms", 0.25), ("2m", 120.0), ("5", 5.0)])
def test_durations(text, value):
    assert parse_duration(text) == value


@pytest.mark.parametrize("bad", ["lots", "1 parsec", ""])
def test_bad_units_are_refused(bad):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(bad)


def test_environment_overrides_and_a_bad_value_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("SPARKBUS_MAX_BUFFER", "2GiB")
    assert from_env("max_buffer", parse_size, 1) == 2 << 30
    monkeypatch.setenv("SPARKBUS_MAX_BUFFER", "")
    assert from_env("max_buffer", parse_size, 1) == 1
    monkeypatch.setenv("SPARKBUS_MAX_BUFFER", "huge")
    with pytest.raises(ValueError, match="SPARKBUS_MAX_BUFFER='huge': not a size"):
        from_env("max_buffer", parse_size, 1)
