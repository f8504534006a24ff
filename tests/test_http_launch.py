"""`rollout-worker --http` flags checked before the model loads: the API key from ROLLOUT_API_KEY, warnings for an
API or a metrics server that anyone on the network can reach, and the connection settings' bounds."""

from __future__ import annotations

import logging

import pytest

from rollout.config import FieldError
from rollout.service.address_checks import check_metrics_address
from rollout.service.http.serving.launch import check_http_address
from rollout.service.http.serving.settings import HttpSettings
from rollout.service.launch.cli import build_parser
from rollout.service.launch.flags import check_settings


def parsed(*flags: str):
    parser = build_parser()
    return parser, parser.parse_args(list(flags))


def test_the_api_key_comes_from_the_environment_when_not_on_the_command_line(monkeypatch):
    monkeypatch.setenv("ROLLOUT_API_KEY", "from-env")  # read as the flag's default, like every ROLLOUT_* variable
    parser, args = parsed("--http", "0.0.0.0:0")
    assert check_http_address(parser, args) == ("0.0.0.0", 0)
    assert args.api_key == "from-env"  # a non-loopback address with a key: no --insecure needed
    parser, args = parsed("--http", "127.0.0.1:0", "--api-key", "given")
    check_http_address(parser, args)
    assert args.api_key == "given"


def test_an_empty_environment_key_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("ROLLOUT_API_KEY", "")
    parser, args = parsed("--http", "127.0.0.1:0")
    with pytest.raises(SystemExit):
        check_http_address(parser, args)
    assert "--api-key (or ROLLOUT_API_KEY): must not be empty" in capsys.readouterr().err


def test_an_open_api_or_metrics_server_is_warned_about(monkeypatch, caplog):
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    caplog.set_level(logging.WARNING, logger="rollout.worker")
    parser, args = parsed("--http", "0.0.0.0:0", "--insecure", "--metrics-port", "0", "--metrics-host", "0.0.0.0")
    check_http_address(parser, args)
    check_metrics_address(parser, args)
    messages = [record.getMessage() for record in caplog.records]
    assert any("HTTP API at 0.0.0.0:0 answers anyone" in m for m in messages), messages
    assert any("--metrics-host 0.0.0.0" in m for m in messages), messages
    caplog.clear()
    parser, args = parsed("--http", "127.0.0.1:0", "--metrics-port", "0")
    check_http_address(parser, args)
    check_metrics_address(parser, args)
    assert not caplog.records


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--http-head-timeout", "0"), "--http-head-timeout"),
        (("--http-keep-alive-timeout", "nan"), "--http-keep-alive-timeout"),
        (("--http-max-waiting-connections", "0"), "--http-max-waiting-connections"),
        (("--http", "0.0.0.0:0"), "needs --api-key or ROLLOUT_API_KEY"),
    ],
)
def test_bad_connection_settings_are_usage_errors(monkeypatch, capsys, flags, message):
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    parser, args = parsed("--http", "127.0.0.1:0", *flags)
    with pytest.raises(SystemExit):
        check_http_address(parser, args)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--enable-control-routes",), "--enable-control-routes is for the HTTP API: give --http"),
        (("--enable-tokenizer-info-endpoint",), "--enable-tokenizer-info-endpoint is for the HTTP API"),
        (("--http", "127.0.0.1:0", "--control-api-key", "k"), "error: --control-api-key is for the control routes"),
        (  # named alone, as given (the error named --control-api-key too, which nobody typed)
            ("--http", "127.0.0.1:0", "--control-allowed-dirs", "/tmp"),
            "error: --control-allowed-dirs is for the control routes: add --enable-control-routes",
        ),
        (("--http", "127.0.0.1:0", "--enable-control-routes", "--control-api-key", ""), "must not be empty"),
        (
            ("--http", "127.0.0.1:0", "--enable-control-routes", "--control-allowed-dirs", "/no/such/dir"),
            "--control-allowed-dirs /no/such/dir: no such directory",
        ),
    ],
)
def test_control_flags_that_cannot_work_are_usage_errors(monkeypatch, capsys, flags, message):
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    monkeypatch.delenv("ROLLOUT_CONTROL_API_KEY", raising=False)
    parser, args = parsed(*flags)
    with pytest.raises(SystemExit):
        check_http_address(parser, args)
    assert message in capsys.readouterr().err


def test_control_routes_open_to_the_generation_key_are_warned_about(monkeypatch, caplog, tmp_path):
    monkeypatch.delenv("ROLLOUT_CONTROL_API_KEY", raising=False)
    caplog.set_level(logging.WARNING, logger="rollout.worker")
    flags = ("--http", "127.0.0.1:0", "--api-key", "k", "--enable-control-routes", "--control-allowed-dirs")
    parser, args = parsed(*flags, str(tmp_path))
    check_http_address(parser, args)
    assert any("without --control-api-key" in record.getMessage() for record in caplog.records)
    monkeypatch.setenv("ROLLOUT_CONTROL_API_KEY", "operator")  # read as the flag's default, kept out of ps
    caplog.clear()
    parser, args = parsed(*flags, str(tmp_path))
    check_http_address(parser, args)
    assert args.control_api_key == "operator" and not caplog.records


def test_served_model_name_is_the_name_clients_use_over_http_and_zeromq(capsys):
    """vLLM's --served-model-name: /v1/models lists it and requests name it (the official openai client); --model's
    own value is then not a served name; the ZeroMQ hello reports it, /server_info both; an empty one is a usage
    error."""
    import httpx
    import openai

    from rollout import protocol as p
    from service_helpers import Client, Worker, free_port

    port = free_port()
    server = Worker("--http", f"127.0.0.1:{port}", "--served-model-name", "my-policy", "--enable-control-routes")
    client = Client(server.address)
    try:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [model.id for model in api.models.list()] == ["my-policy"]
        answer = api.completions.create(model="my-policy", prompt="Hello", max_tokens=2, temperature=0)
        assert answer.model == "my-policy" and answer.choices[0].text is not None
        with pytest.raises(
            openai.NotFoundError, match="the model `tiny` does not exist: this worker serves `my-policy`"
        ):
            api.completions.create(model="tiny", prompt="Hello", max_tokens=2)
        assert client.ask(p.Hello()).model == "my-policy"
        info = httpx.get(f"http://127.0.0.1:{port}/server_info", params={"config_format": "json"}, timeout=30).json()
        model_config = info["vllm_config"]["model_config"]  # vLLM's: the path in `model`, the name beside it
        assert (model_config["model"], model_config["served_model_name"]) == ("tiny", "my-policy")
    finally:
        client.close()
        server.close()
    parser, args = parsed("--served-model-name", " ")
    with pytest.raises(SystemExit):
        check_settings(parser, args)
    assert "--served-model-name: empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    "key, shown", [("secret\n", "'\\n'"), (" secret", "' '"), ("sec\tret", "'\\t'"), ("sécret", "'é'")]
)
@pytest.mark.parametrize("flag, variable", [("--api-key", "ROLLOUT_API_KEY"), ("--control-api-key", None)])
def test_a_key_no_http_client_can_send_is_a_usage_error(monkeypatch, capsys, key, shown, flag, variable):
    """HTTP trims a header value's surrounding whitespace and carries no control characters, and the openai client
    sends header values as ASCII: a key read with a trailing newline (a secret file's) was taken, and every request
    was then answered 401."""
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    monkeypatch.delenv("ROLLOUT_CONTROL_API_KEY", raising=False)
    if variable is not None:
        monkeypatch.setenv(variable, key)
        parser, args = parsed("--http", "127.0.0.1:0", "--enable-control-routes")
    else:
        parser, args = parsed("--http", "127.0.0.1:0", "--enable-control-routes", flag, key)
    with pytest.raises(SystemExit):
        check_http_address(parser, args)
    error = capsys.readouterr().err
    assert f"{flag}" in error and shown in error and "no HTTP client can send" in error, error
    with pytest.raises(FieldError, match="no HTTP client can send"):  # (the in-process server's settings too)
        HttpSettings(**{flag.removeprefix("--").replace("-", "_"): key})


def test_server_info_reports_no_variable_whose_name_says_it_holds_a_secret():
    """Only names holding KEY were left out: ROLLOUT_HF_TOKEN, VLLM_DB_PASSWORD... were reported to control clients."""
    from rollout.service.http.control.server_info import reported_environment

    environment = {
        "ROLLOUT_LOG_LEVEL": "INFO",
        "VLLM_USE_V1": "1",
        "ROLLOUT_API_KEY": "k",
        "ROLLOUT_HF_TOKEN": "t",
        "VLLM_DB_PASSWORD": "p",
        "ROLLOUT_CLIENT_SECRET": "s",
        "VLLM_AUTH_HEADER": "a",
        "ROLLOUT_gcs_credentials": "c",
        "HOME": "/root",
    }
    assert reported_environment(environment) == {"ROLLOUT_LOG_LEVEL": "INFO", "VLLM_USE_V1": "1"}
