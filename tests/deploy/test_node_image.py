"""The sandlot node image (scripts/build-node-image.sh), built for real and run.

One container plays a whole Ray cluster's head: it runs ``sandlot doctor`` and
``sandlot-node-prepare``, starts Ray from the image's ``ray`` (KubeRay starts it the same
way, from a login shell), asks the endpoints KubeRay's health probes ask, puts a sandlot
node actor on it and runs a batch whose programs run in bubblewrap sandboxes inside the
container. The container gets the privileges the KubeRay manifests give a
sandlot node (``privileged``, see docs/kubernetes.md); the control runs the same image
without them and must see sandlot refuse, which is why a node needs them.

The engine is Podman's command line (CI installs it with scripts/setup-docker.sh; no
service needed), or the one named by ``$SANDLOT_NODE_IMAGE_ENGINE`` ("docker"). Podman's
``--privileged`` grants the capabilities root has; Docker's asks for every one and fails
("unable to apply caps") where root's bounding set lacks one, as on the CI machines,
which have no CAP_SYS_RESOURCE: there Docker cannot run a privileged container at all.
The first build takes about 3 minutes on 2 cores with a warm package cache; a build with
nothing changed is reused from the image's key label in seconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "build-node-image.sh"
ENGINE = os.environ.get("SANDLOT_NODE_IMAGE_ENGINE", "podman")
TAG = "sandlot/node:test"

pytestmark = [
    pytest.mark.slow,
    # Podman's command line needs no service (requires_podman checks its API socket).
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")
    if ENGINE == "podman"
    else pytest.mark.requires_docker,
    pytest.mark.skipif(os.geteuid() != 0, reason="the image build needs root (chroot)"),
]

# Explicit limits: an engine's defaults may exceed what the host lets it set (seen with
# Podman in a session without CAP_SYS_RESOURCE), and Ray wants many descriptors.
ULIMITS = ["--ulimit", "nofile=16384:16384", "--ulimit", "nproc=16384:16384"]

INSIDE = r"""
set -e
echo "RAY_VERSION $(ray --version)"
echo "DOCTOR $(sandlot doctor --json | tr -d '\n')"
# What the KubeRay manifests run: the image's preparation, then KubeRay's own `ray start`.
sandlot-node-prepare
ray start --head --disable-usage-stats --num-cpus=2 --dashboard-host=127.0.0.1 \
    >/tmp/ray-start.log 2>&1 || { cat /tmp/ray-start.log; exit 1; }
# KubeRay's health probes: for Ray >= 2.53 an HTTP GET of the dashboard agent on the pod's
# address; older releases run wget against the agent and the dashboard. The agent comes up
# beside the raylet, after `ray start` returns: asked until it answers, as KubeRay does.
ip=$(hostname -i | cut -d' ' -f1)
probe=down
for _ in $(seq 1 120); do
    if wget --tries 1 -T 2 -q -O /dev/null "http://$ip:52365/api/healthz"; then probe=up; break; fi
    sleep 0.5
done
echo "PROBE $probe" \
    "$(wget --tries 1 -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz)" \
    "$(wget --tries 1 -T 2 -q -O- http://localhost:8265/api/gcs_healthz)"
python - <<'PY'
import json, ray
from sandlot.ray import SandlotCluster, run_batch
ray.init(address="auto", logging_level="ERROR")
with SandlotCluster(slots_per_node=2) as cluster:
    out = run_batch(
        ["print(6 * 7)", "import pandas; print(pandas.__version__)", "1 / 0"], cluster=cluster
    )
print("BATCH " + json.dumps(
    [[e.status, "".join(e.logs.stdout), e.error.name if e.error else None] for e in out]
))
PY
ray stop >/dev/null 2>&1
"""


def _tagged(output: str, tag: str) -> str:
    for line in output.splitlines():
        if line.startswith(tag + " "):
            return line[len(tag) + 1 :]
    raise AssertionError(f"no {tag} line in the container's output:\n{output[-4000:]}")


def _checks(doctor: dict[str, object]) -> dict[str, str]:
    return {c["name"]: c["status"] for c in doctor["checks"]}  # type: ignore[attr-defined,index]


@pytest.fixture(scope="module")
def node_image() -> str:
    started = time.monotonic()
    built = subprocess.run(
        ["bash", str(SCRIPT), "--engine", ENGINE, "--tag", TAG],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    assert built.stdout.strip().splitlines()[-1] == TAG
    print(f"node image built (or reused) in {time.monotonic() - started:.0f} s")
    return TAG


def _run(image: str, *options: str, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ENGINE, "run", "--rm", *ULIMITS, *options, image, "bash", "-lc", script],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.timeout(2400)
def test_node_image_runs_sandboxes_as_a_ray_node(node_image: str) -> None:
    ran = _run(node_image, "--privileged", script=INSIDE)
    output = ran.stdout + ran.stderr
    assert ran.returncode == 0, output[-4000:]

    wanted = re.search(
        r'RAY_VERSION="\$\{SANDLOT_NODE_RAY_VERSION:-([0-9.]+)\}"', SCRIPT.read_text()
    )
    assert wanted is not None
    assert _tagged(output, "RAY_VERSION").strip() == f"ray, version {wanted.group(1)}"

    assert _tagged(output, "PROBE") == "up success success"

    doctor = json.loads(_tagged(output, "DOCTOR"))
    checks = _checks(doctor)
    for name in ("backend bwrap", "seccomp", "cgroups", "template python-data", "CJK font"):
        assert checks.get(name) == "ok", (name, doctor)
    assert doctor["auto"] in ("bwrap", "zygote")

    batch = json.loads(_tagged(output, "BATCH"))
    assert batch[0] == ["ok", "42\n", None]
    assert batch[1][0] == "ok" and re.fullmatch(r"\d+\.\d+\.\d+\n", batch[1][1])
    assert batch[2] == ["error", "", "ZeroDivisionError"]


@pytest.mark.timeout(2400)
def test_control_without_privileges_sandlot_refuses(node_image: str) -> None:
    """The engine's default confinement (read-only cgroups, its seccomp profile, masked
    /proc) leaves sandlot without the layers it requires: doctor says so and a sandbox
    is refused with the fix, never run with less isolation."""
    ran = _run(
        node_image,
        script='sandlot doctor --json | tr -d "\\n"; echo; echo "print(1)" | sandlot run -; '
        "sandlot-node-prepare && echo PREPARED",
    )
    doctor = json.loads(ran.stdout.splitlines()[0])
    checks = _checks(doctor)
    assert checks["backend bwrap"] == "missing", doctor
    assert checks["cgroups"] == "missing", doctor
    assert ran.returncode != 0
    assert "never runs code unsandboxed" in ran.stderr, ran.stderr[-2000:]
    assert "\n1\n" not in "\n" + ran.stdout
    # The node's preparation stops the container before Ray starts, saying why.
    assert "PREPARED" not in ran.stdout
    assert "a sandlot node needs a privileged container" in ran.stderr, ran.stderr[-2000:]
