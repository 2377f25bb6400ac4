"""No silent degradation in elastic mode: a torchft the project does not support is refused when the strategy is
built; a process group that cannot be set up for good ends the run with its error; one that fails for a transient
reason (the rendezvous met a network failure) is taken alone as before, but counted in each round's report and
logged as ``outer/membership_errors``."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from lightning_loco import ElasticConfig, NoLoCoStrategy
from lightning_loco.driver.reports import OuterStepReport
from lightning_loco.elastic import torchft_version
from lightning_loco.elastic.group_setup import GroupSetupError, transient
from lightning_loco.trainer.monitoring import OuterStepMonitor

from elastic_fakes import H, Hub, Script, elastic_runner, in_threads

# ---------------------------------------------------------------- the installed torchft's version


@pytest.mark.parametrize("installed", ["0.3.0", "0.1.1", None])
def test_a_torchft_other_than_the_pinned_one_is_refused_when_the_strategy_is_built(monkeypatch, installed):
    pytest.importorskip("torchft", reason="the elastic extra: pip install 'lightning-loco[elastic]'")
    monkeypatch.setattr(torchft_version, "installed_torchft_version", lambda: installed)
    with pytest.raises(ImportError) as refused:
        NoLoCoStrategy(sync_every=4, elastic=ElasticConfig("127.0.0.1:1", replica_id="a"))
    message = str(refused.value)
    assert "support torchft 0.2.0 only" in message, message
    assert (f"torchft {installed} is installed" if installed else "has no version") in message, message
    assert "pip install torchft==0.2.0" in message and "elastic=None" in message, message


@pytest.mark.parametrize("installed", ["0.2.0", "0.2.0+cpu", "0.2.0.post1"])
def test_the_pinned_torchft_is_taken(monkeypatch, installed):
    pytest.importorskip("torchft", reason="the elastic extra: pip install 'lightning-loco[elastic]'")
    monkeypatch.setattr(torchft_version, "installed_torchft_version", lambda: installed)
    assert NoLoCoStrategy(sync_every=4, elastic=ElasticConfig("127.0.0.1:1", replica_id="a")).elastic is not None


def test_the_installed_torchft_is_the_supported_one():
    pytest.importorskip("torchft", reason="the elastic extra: pip install 'lightning-loco[elastic]'")
    assert torchft_version.release_of(torchft_version.installed_torchft_version() or "") == "0.2.0"


# ---------------------------------------------------------------- a membership's process group


def test_which_errors_are_transient():
    for err in (TimeoutError("timed out"), ConnectionRefusedError(111, "refused"), ConnectionResetError("reset"),
                RuntimeError("[gloo] Connection closed by peer"), OSError("no route to host")):
        assert transient(err), err
    for err in (AttributeError("'ProcessGroupGloo' object has no attribute 'configure'"), TypeError("configure()"),
                ImportError("torchft"), NotImplementedError(), ValueError("bad rank")):
        assert not transient(err), err


class BrokenGloo:
    """torchft's ProcessGroupGloo whose ``configure`` raises ``error``."""

    error: BaseException = RuntimeError()

    def __init__(self, timeout: Any = None) -> None:
        pass

    def configure(self, *args: Any, **kwargs: Any) -> None:
        raise self.error


def one_membership(monkeypatch, error: BaseException):
    """A replica alone over a Lighthouse in this process, whose group's rendezvous raises ``error``."""
    pytest.importorskip("torchft", reason="the elastic extra: pip install 'lightning-loco[elastic]'")
    import torchft.process_group
    from torchft.coordination import LighthouseServer

    from lightning_loco.elastic.membership import Membership

    monkeypatch.setattr(BrokenGloo, "error", error)
    monkeypatch.setattr(torchft.process_group, "ProcessGroupGloo", BrokenGloo)
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=10_000, heartbeat_timeout_ms=2000)
    address = server.address().split("://", 1)[-1]
    config = ElasticConfig(lighthouse=address, replica_id="a", join_timeout=30.0, outer_step_timeout=20.0)
    return server, Membership(config)


@pytest.mark.parametrize("error", [AttributeError("'ProcessGroupGloo' object has no attribute 'configure'"),
                                   TypeError("configure() got an unexpected keyword argument 'timeout'")],
                         ids=["attribute", "type"])
def test_a_group_that_cannot_be_set_up_for_good_ends_the_run_with_its_error(monkeypatch, error):
    server, membership = one_membership(monkeypatch, error)
    try:
        with pytest.raises(GroupSetupError) as stopped:
            membership.at_switch(0, dict, lambda state, healed: 0)
        message = str(stopped.value)
        assert f"{type(error).__name__}: {error}" in message, message
        assert "the run stops" in message and "pip install torchft==0.2.0" in message, message
        assert stopped.value.__cause__ is error
        assert membership.group_errors == []
    finally:
        membership.close()
        server.shutdown()


def test_a_transient_failure_is_taken_alone_and_counted(monkeypatch, caplog):
    server, membership = one_membership(monkeypatch, ConnectionResetError("Connection reset by peer"))
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_loco"):
            assert membership.at_switch(0, dict, lambda state, healed: 0) == 0
            assert membership.view is not None and membership.view.pg is None  # the membership's rounds: alone
            # The membership after it was asked for in the background at the switch; its rendezvous fails too.
            # Waited for, so that the count below does not depend on how far that request got.
            after = membership._request
            assert after is not None
            after.thread.join(60)
            assert not after.thread.is_alive(), after.doing
        reset = "ConnectionResetError: Connection reset by peer"
        assert [e["error"] for e in membership.group_errors] == [reset, reset]
        assert [e["quorum_id"] for e in membership.group_errors] == [1, 1]  # the Lighthouse's quorum is unchanged
        assert "outer/membership_errors" in caplog.text and "taken alone" in caplog.text
        assert "(1 such membership(s) so far" in caplog.text and "(2 such membership(s) so far" in caplog.text
    finally:
        membership.close()
        server.shutdown()


# ---------------------------------------------------------------- the count, in each round's report and the logger


def test_each_rounds_report_counts_the_groups_that_failed_so_far():
    hub = Hub()
    script = [Script(quorum_id=1, switch=0, members=("a", "b"))]
    a, b = (elastic_runner(hub, r, i, script) for i, r in enumerate("ab"))
    in_threads(lambda: a.run(H), lambda: b.run(H))
    a.driver.transport.membership.group_errors.append({"quorum_id": 7, "error": "RuntimeError: timed out"})
    in_threads(lambda: a.run(H), lambda: b.run(H))
    assert [r.membership_errors for r in a.driver.reports] == [0, 1]
    assert [r.membership_errors for r in b.driver.reports] == [0, 0]
    metrics = OuterStepMonitor._metrics(a.driver.reports[-1], 1)
    assert metrics["outer/membership_errors"] == 1.0
    plain = OuterStepReport(0, 3, 40, (1,), 100, 100, 0.1, 0.2)  # the static launch: nothing logged
    assert "outer/membership_errors" not in OuterStepMonitor._metrics(plain, 1)


def test_a_dropped_round_leaves_no_report_and_the_reports_before_it_keep_their_count():
    """A DiLoCo round finished alone is dropped: it makes no report (the next round's report counts the failures
    so far), and the report before it keeps its own count. A replica whose first round was dropped raised
    ``IndexError`` here."""
    from lightning_loco.algorithms import DiLoCo

    script = [Script(quorum_id=1, switch=0, members=("a", "b"))]
    first = Hub()  # the partner gone before the first round
    a, _ = (elastic_runner(first, r, i, script, DiLoCo()) for i, r in enumerate("ab"))
    first.kill("b")
    with pytest.warns(UserWarning, match="finished the round alone"):
        a.run(H)
    assert a.driver.plugin.rounds[-1]["dropped"] and a.driver.reports == []

    later = Hub()  # one round together, a failure counted, then the partner gone
    a, b = (elastic_runner(later, r, i, script, DiLoCo()) for i, r in enumerate("ab"))
    in_threads(lambda: a.run(H), lambda: b.run(H))
    a.driver.transport.membership.group_errors.append({"quorum_id": 7, "error": "RuntimeError: timed out"})
    later.kill("b")
    with pytest.warns(UserWarning, match="finished the round alone"):
        a.run(H)
    assert a.driver.plugin.rounds[-1]["dropped"]
    assert [r.membership_errors for r in a.driver.reports] == [0]  # the round before keeps its count
