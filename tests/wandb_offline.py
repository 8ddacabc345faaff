"""Reading a wandb offline run without a service (for tests): the `run-<id>.wandb` file is a
LevelDB-style log (a 7-byte W&B header, 32 KiB blocks, records with a 7-byte header: crc32,
length, type FULL / FIRST / MIDDLE / LAST) of wandb's own protobuf Records."""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768


def _records(data: bytes):
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:   # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def read_offline_run(folder, min_rows: int = 0, timeout: float = 30.0) -> tuple[str, str, list[dict]]:
    """(run id, project, history rows {key: value}) of one offline-run-* folder. With min_rows:
    read again until it holds that many rows, for up to `timeout` seconds (a CI run under load once
    read the file before wandb's service had written the row that run.finish() had been given)."""
    import time
    deadline = time.monotonic() + timeout
    while True:
        found = _read_offline_run(folder)
        if len(found[2]) >= min_rows or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def _read_offline_run(folder) -> tuple[str, str, list[dict]]:
    from wandb.proto import wandb_internal_pb2
    (path,) = Path(folder).glob("run-*.wandb")
    run_id = project = None
    rows = []
    for raw in _records(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id, project = record.run.run_id, record.run.project
        elif kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return run_id, project, rows
