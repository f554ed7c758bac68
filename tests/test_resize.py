"""An instance resize is one durable reconfiguration (DESIGN section 13), with real
controller and replica processes: new replicas that miss the deadline are dropped (the
old ones kept), and a resize whose controller is killed with SIGKILL halfway is
finished by the next one. The old replica is an external address nothing listens on:
it costs no process and is never in sync, so only the new replicas decide."""

from __future__ import annotations

import threading

import pytest

from catalog import Catalog, default_url
from controller._process import ControllerProcess, kill_replicas, wait_until
from controller.client import Client, TandemError

pytestmark = pytest.mark.spark


def replicas(catalog: Catalog) -> list[str]:
    return sorted(r.name for r in catalog.list_replicas("main"))


def test_a_resize_rolls_back_on_timeout_and_is_finished_after_a_controller_restart(tmp_path):
    controller = ControllerProcess(tmp_path)
    catalog = Catalog.open(default_url(tmp_path))
    client = Client.connect(controller.address)
    try:
        client.create_instance("main")
        client.add_replica("main", "old", address="127.0.0.1:1")

        with pytest.raises(TandemError) as timed_out:
            client.resize("main", "xsmall", timeout_ms=1)
        assert timed_out.value.code.name == "DEADLINE_EXCEEDED" and "rolled back" in timed_out.value.message
        assert replicas(catalog) == ["old"] and catalog.list_reconfigurations() == []
        with pytest.raises(TandemError) as refused:
            client.resize("main", "xsmall", timeout_ms=1, on_timeout="later")
        assert refused.value.code.name == "INVALID_ARGUMENT" and replicas(catalog) == ["old"]

        # Killed once the resize is recorded and its new replica too, before it is ready.
        resizing = threading.Thread(target=lambda: _quietly(lambda: client.resize("main", "xsmall", timeout_ms=180_000)), daemon=True)
        resizing.start()
        wait_until(lambda: "xsmall_1" in replicas(catalog), 60, "the new replica recorded")
        [record] = catalog.list_reconfigurations()
        assert (record.old, record.new, record.on_timeout) == (("old",), ("xsmall_1",), "rollback")
        controller.kill()
        resizing.join(30)

        controller = ControllerProcess(tmp_path, log_name="controller-2.log")
        client.close()
        client = Client.connect(controller.address)
        wait_until(lambda: replicas(catalog) == ["xsmall_1"], 180, "the resize finished by the new controller")
        # Noted after the old replicas are dropped and the record ended: waited for.
        assert wait_until(lambda: resize_events_after_takeover(client.events("main")), 60, "the resize's end noted") == ["resize_committed"]
        assert catalog.list_reconfigurations() == []
        events = client.events("main")
        took_over = max(e.id for e in events if e.kind == "took_over" and "epoch 2" in e.message)
        assert [e.kind for e in events if e.id < took_over and e.kind.startswith("resize")][:2] == ["resize_started", "resize_rolled_back"]
    finally:
        client.close()
        controller.kill()
        catalog.close()
        kill_replicas(tmp_path)


def resize_events_after_takeover(events: list) -> list[str]:
    """The kinds of the resize events noted after epoch 2 took over, in order (none
    while its takeover is not noted yet)."""
    took_over = max((e.id for e in events if e.kind == "took_over" and "epoch 2" in e.message), default=None)
    return [] if took_over is None else [e.kind for e in events if e.id > took_over and e.kind.startswith("resize")]


def _quietly(call) -> None:
    try:
        call()
    except TandemError:
        pass  # its controller was killed: the next one carries the resize on
