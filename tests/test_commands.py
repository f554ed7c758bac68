"""Commands refuse values that break their invariants when they are built, so nothing
downstream (history, codec, replica) ever sees them."""

import pytest

import history as h


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: h.Predicate("a", "like", "x%"), "unknown predicate op 'like'"),
        (lambda: h.Predicate("a", "in", 1), "needs a tuple"),
        (lambda: h.Predicate("a", "=", (1, 2)), "cannot take a tuple"),
        (lambda: h.Predicate("a", "is_null", 0), "takes no value"),
        (lambda: h.Peek("p", h.IndexTarget("u1"), -1), "non-negative"),
        (lambda: h.InstanceConfig("i", (("b", "1"), ("a", "2"))), "sorted by key"),
        (lambda: h.InstanceConfig("i", (("a", "1"), ("a", "2"))), "without duplicates"),
    ],
)
def test_invalid_values_are_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_instance_config_of_sorts_and_round_trips():
    config = h.InstanceConfig.of("i", {"b": "1", "a": "2"})
    assert config.spark_conf == (("a", "2"), ("b", "1"))
    assert config.conf() == {"a": "2", "b": "1"}


def test_compute_parameters_update_keeps_none_fields():
    old = h.ComputeParameters(max_result_rows=5, heartbeat_interval_ms=100)
    new = old.update(h.ComputeParameters(heartbeat_interval_ms=200, input_poll_interval_ms=50))
    assert new == h.ComputeParameters(max_result_rows=5, heartbeat_interval_ms=200, input_poll_interval_ms=50)


def test_same_definition_ignores_as_of_only():
    desc = h.DataflowDescription("d", "select 1", (), (h.IndexExport("u2"),), as_of=h.Frontier(3))
    assert desc.same_definition(desc.with_as_of(h.Frontier(9)))
    assert not desc.same_definition(h.DataflowDescription("d", "select 2", (), (h.IndexExport("u2"),)))
