"""`RolloutFleet.launch`'s worker_args checked on the driver, before Ray starts anything, and the worker's command line
the fleet builds: what a worker would refuse at its start is a ValueError naming it (it was a RuntimeError naming
rollout.ray.actor._UsageError once every actor had loaded, or for an HTTP API flag without http=True no error at all),
and ROLLOUT_* variables of the environment do not reach the flags the fleet sets itself."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from rollout.ray import RolloutFleet  # noqa: E402


@pytest.mark.parametrize(
    "worker_args, message",
    [
        (["--max-n", "0"], "worker_args: --max-n: must be positive"),
        (["--num-blocks", "0"], "worker_args: --num-blocks"),
        (["--metrics-host", "0.0.0.0"], "worker_args: --metrics-host 0.0.0.0: has no effect"),
        (["--http-max-body-bytes", "4096"], "worker_args: --http-max-body-bytes: has no effect"),
        (["--tool-call-parser", "hermes"], "worker_args: --tool-call-parser: has no effect"),
        (["--help"], "worker_args: --help is not a worker setting"),  # printed the whole help, then "0"
        # The control routes' flags: every worker failed at its start, once Ray had placed them all.
        (["--enable-control-routes"], r"--enable-control-routes is for the HTTP API.*http=True"),
        (["--enable-tokenizer-info-endpoint"], r"--enable-tokenizer-info-endpoint is for the HTTP API.*http=True"),
        (["--control-allowed-dirs", "/tmp"], r"--control-allowed-dirs is for the HTTP API.*http=True"),
    ],
)
def test_what_a_worker_would_refuse_is_refused_before_ray_starts(worker_args, message):
    assert not ray.is_initialized()
    with pytest.raises(ValueError, match=message):
        RolloutFleet.launch(1, resources_per_worker={"CPU": 1}, worker_args=worker_args)
    assert not ray.is_initialized()  # found before Ray started


def test_the_fleets_own_flags_take_no_rollout_variable_from_the_environment(monkeypatch):
    """ROLLOUT_API_KEY, kept for workers started by hand, reached every worker of a fleet as --api-key: without
    http=True each failed to start ("--api-key protects the HTTP API"); the fleet's own key must win with it."""
    from types import SimpleNamespace

    from rollout.ray.actor import worker_argv, worker_parser

    monkeypatch.setenv("ROLLOUT_API_KEY", "operator-key")
    monkeypatch.setenv("ROLLOUT_INSECURE", "1")
    monkeypatch.setenv("ROLLOUT_AUTHORIZED_KEYS", "/somewhere")
    files = SimpleNamespace(worker_secret="w.key_secret", trainer_keys="trainers")
    args = worker_parser().parse_args(worker_argv(["--model", "tiny"], "10.0.0.7", files, False, None))
    assert (args.api_key, args.http, args.insecure, args.authorized_keys) == (None, None, False, None)
    args = worker_parser().parse_args(worker_argv(["--model", "tiny"], "10.0.0.7", files, True, "fleet-key"))
    assert args.api_key == "fleet-key"


def test_http_flags_pass_with_http():
    from rollout.ray.actor import check_worker_args

    check_worker_args(["--http-max-body-bytes", "4096", "--tool-call-parser", "hermes"], http=True)


def test_control_flags_are_checked_on_the_driver_and_their_directories_on_the_node(tmp_path):
    """With http=True the control flags' rules hold on the driver as on a worker; a directory is the node's to
    check (the driver's filesystem is not the workers')."""
    from rollout.ray.actor import check_worker_args

    with pytest.raises(ValueError, match="worker_args: --control-api-key is for the control routes"):
        check_worker_args(["--control-api-key", "operator"], http=True)
    with pytest.raises(ValueError, match="worker_args: --control-api-key .*must not be empty"):
        check_worker_args(["--enable-control-routes", "--control-api-key", ""], http=True)
    elsewhere = str(tmp_path / "on-the-nodes-only")
    check_worker_args(["--enable-control-routes", "--control-allowed-dirs", elsewhere], http=True)


def test_the_drivers_control_variables_are_not_checked_as_worker_args(monkeypatch):
    """ROLLOUT_CONTROL_API_KEY or ROLLOUT_ENABLE_CONTROL_ROUTES in the driver's environment (kept for workers started
    by hand) is no worker_args entry: a fleet without http=True was refused ('--control-api-key is for the HTTP API')
    though its workers read their own node's environment, as they do with rollout-worker's other variables."""
    from rollout.ray.actor import check_worker_args

    monkeypatch.setenv("ROLLOUT_CONTROL_API_KEY", "k" * 40)
    monkeypatch.setenv("ROLLOUT_ENABLE_CONTROL_ROUTES", "1")
    check_worker_args([])
    with pytest.raises(ValueError, match="worker_args: --enable-control-routes is for the HTTP API"):
        check_worker_args(["--enable-control-routes"])
