"""`megatron-id generate` and `serve` as a careless user runs them (issue 52): prompts from a pipe,
sizes and timeouts that are not numbers one can use, --port 0, a model name with braces, two
servers started at once on one port, --allowed-host with a scheme or a port. In-process
(megatron_id.cli.main), each refusal one line before the model is loaded."""
from __future__ import annotations

import os
import socket
import threading

import pytest
from hf_tiny import tiny_export

from megatron_id.cli import main


def test_prompts_from_a_pipe_are_read(tmp_path):
    """`--input-file <(grep water prompts.txt)` names a pipe (/dev/fd/63): it was refused as
    "no such file"."""
    from megatron_id.commands.generate import read_prompts
    fifo = tmp_path / "prompts"
    os.mkfifo(fifo)

    def write():
        with open(fifo, "w") as f:
            f.write("The water cycle\n\nRivers\n")
    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert read_prompts(str(fifo)) == ["The water cycle", "Rivers"]
    finally:
        writer.join(timeout=5)
        if writer.is_alive():   # (read_prompts refused it: a reader that never blocks lets the writer's open end)
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
            writer.join(timeout=10)
        # (a blocking open() here hung CI for 15 minutes: the writer had written and closed, but its
        # thread had not yet ended when is_alive() was asked, and no writer came for that reader)


@pytest.mark.parametrize("args, mention", [
    # inf: an OverflowError traceback once the host and port were tried
    (["--max-body-size", "inf"], "--max-body-size inf: the largest body in MiB, from 0.001 (1 KiB) to any finite"),
    # a body limit of 0 bytes: every request 413
    (["--max-body-size", "0.0000001"], "--max-body-size 1e-07: the largest body in MiB, from 0.001"),
    # nan was taken: the drain then ended at once
    (["--drain-timeout", "nan"], "--drain-timeout nan: a port up to 65535, a timeout of at least 0 seconds"),
])
def test_serve_refuses_sizes_and_timeouts_it_cannot_use(args, mention, tmp_path, capsys):
    assert main(["serve", "--checkpoint", str(tmp_path / "nope"), *args]) == 2
    assert mention in capsys.readouterr().err


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return tiny_export(tmp_path_factory.mktemp("careless") / "hf")


def test_the_listening_line_names_the_port_0_chose_and_any_model_name(export, capsys, monkeypatch):
    """--port 0: the line said http://127.0.0.1:0; --served-model-name 'x{y}': a KeyError
    traceback (the line was a format string)."""
    import torch

    from megatron_id.inference import server
    ran = {}

    def run_app(app, **kwargs):   # listening: the line is printed, then a signal stops it
        ran.update(kwargs)
        kwargs["print"]("")
    monkeypatch.setattr(server.web, "run_app", run_app)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)   # (serve's --threads: not for the tests after)
    assert main(["serve", "--checkpoint", str(export), "--port", "0", "--served-model-name", "x{y}",
                 "--threads", "1"]) == 0
    assert ran["port"] > 0
    assert f"megatron-id serve: x{{y}} on http://127.0.0.1:{ran['port']} (8 slots" in capsys.readouterr().err


def test_a_port_taken_while_the_model_loads_is_named_with_its_flag(export, capsys, monkeypatch):
    """Two servers started at once on one port both find it free before loading; the second
    failed at the end with aiohttp's words ("error while attempting to bind"), exit 1."""
    import torch

    from megatron_id.inference import server
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)   # (serve's --threads: not for the tests after)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        # the other server binds after this one tried the port
        monkeypatch.setattr(server, "check_listen_address", lambda host, port: port)
        assert main(["serve", "--checkpoint", str(export), "--port", str(port), "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert f"megatron-id: error: --port {port}: port {port} on 127.0.0.1 was taken while the model loaded (another " \
           f"server started at the same time?): stop it or choose another --port." in err, err


@pytest.mark.parametrize("name", ["http://example.com", "example.com:8000", "[::1]:8000", ""])
def test_an_allowed_host_with_a_scheme_or_a_port_is_refused(name, tmp_path, capsys):
    """They never match a Host header's name: every request got 403."""
    assert main(["serve", "--checkpoint", str(tmp_path / "nope"), "--allowed-host", name]) == 2
    assert f"--allowed-host {name!r}: give a host name or address only, without a scheme or a port" in \
        capsys.readouterr().err


def test_allowed_hosts_are_matched_as_headers_are_read():
    """--allowed-host MyBox.local never matched: a Host header's name is read in lower case."""
    import argparse

    from megatron_id.inference.server import serve_limits
    args = argparse.Namespace(allowed_host=["MyBox.Local", "[fe80::1]"], host="0.0.0.0", api_key=None,
                              drain_timeout=30.0, max_pending_per_client=None, read_timeout=30.0,
                              request_timeout=600.0, max_body_size=4.0)
    assert serve_limits(args, None).allowed_hosts == {"mybox.local", "fe80::1"}
