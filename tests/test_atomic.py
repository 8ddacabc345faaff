"""megatron_id.atomic: the one atomic file write the package uses."""
import os
import stat
import subprocess
import sys

import pytest

from megatron_id.atomic import umask, write_atomic, write_atomic_bytes, write_atomic_text


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_writes_and_replaces(tmp_path):
    target = tmp_path / "a.json"
    write_atomic_text(target, "one\n")
    assert target.read_text() == "one\n"
    write_atomic_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    seen = []
    write_atomic(target, lambda tmp: (seen.append(tmp), tmp.write_text("three")))
    assert target.read_text() == "three"
    # the temporary file was beside the target, hidden, named after it, and is gone
    assert seen[0].parent == tmp_path and seen[0].name.startswith(".a.json.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_failure_keeps_old_content_and_cleans_up(tmp_path, error):
    target = tmp_path / "a.txt"
    target.write_text("old")

    def writer(tmp):
        tmp.write_text("half")
        raise error("stop")
    with pytest.raises(error):
        write_atomic(target, writer)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_failure_without_a_target_leaves_nothing(tmp_path):
    with pytest.raises(OSError):
        write_atomic(tmp_path / "new.bin", lambda tmp: (tmp.write_bytes(b"x"), os.rmdir(tmp_path / "missing")))
    assert list(tmp_path.iterdir()) == []


def test_named_temporary_file(tmp_path):
    target = tmp_path / "out.json"
    temp = tmp_path / f".out.json.tmp-{os.getpid()}"
    write_atomic_text(target, "x", temp=temp)
    assert target.read_text() == "x" and not temp.exists()
    with pytest.raises(RuntimeError):
        write_atomic(target, lambda tmp: (tmp.write_text("y"), (_ for _ in ()).throw(RuntimeError())), temp=temp)
    assert target.read_text() == "x" and not temp.exists()


def test_permissions_of_a_plain_new_file(tmp_path):
    # mkstemp makes 0o600 files: the result must instead have what open() gives a new file
    write_atomic_text(tmp_path / "a", "x")
    (tmp_path / "plain").write_text("x")
    assert _mode(tmp_path / "a") == _mode(tmp_path / "plain") == 0o666 & ~umask()
    # the permissions of the replaced file are not carried over either: a new file's, as before
    os.chmod(tmp_path / "a", 0o600)
    write_atomic_text(tmp_path / "a", "y")
    assert _mode(tmp_path / "a") == 0o666 & ~umask()
    write_atomic_bytes(tmp_path / "tool", b"#!", mode=0o777)
    assert _mode(tmp_path / "tool") == 0o777 & ~umask()


def test_permissions_follow_the_umask(tmp_path):
    code = ("import os, stat, sys; from pathlib import Path; os.umask(0o027); "
            "from megatron_id.atomic import write_atomic_text, umask; p = Path(sys.argv[1]); "
            "write_atomic_text(p, 'x'); print(oct(stat.S_IMODE(p.stat().st_mode)), oct(umask()))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "f")], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [oct(0o640), oct(0o027)]


def test_umask_is_not_changed(tmp_path):
    before = os.umask(0o022)
    try:
        assert umask() == 0o022
        write_atomic_text(tmp_path / "a", "x")
        assert os.umask(0o022) == 0o022
    finally:
        os.umask(before)


def test_imports_nothing_from_the_package():
    code = ("import sys; import megatron_id.atomic; "
            "print(sorted(m for m in sys.modules if m.startswith('megatron_id') and m != 'megatron_id.atomic'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # the package's own __init__ runs first; atomic itself adds nothing
    import_init = subprocess.run([sys.executable, "-c", "import sys, megatron_id; print(sorted(m for m in "
                                  "sys.modules if m.startswith('megatron_id')))"],
                                 capture_output=True, text=True, check=True).stdout
    assert out.strip() == import_init.strip()
