"""Every report of the NCCL version names the libnccl file it read and why
that one: strata.nccl.find() / library(), strata.topology's report (text,
JSON), strata-topo, build_info(). Which file a process gets depends on how
it was started, so each case runs in a fresh interpreter: without torch
(the dynamic loader's search path), with torch imported first (torch's
copy), with STRATA_NCCL_LIBRARY, with LD_LIBRARY_PATH. The references are
computed in the same process: the files /proc/self/maps shows, and
ncclGetVersion called through ctypes."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

TOPO = os.environ.get("STRATA_TOPO_BIN")
FIXTURE_SYS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                           "topology", "dgx_h100", "sys")

# Runs in the child: `setup` first (e.g. import torch), then reports as JSON.
CHILD = textwrap.dedent("""\
    import ctypes, json, os, sys
    {setup}
    import strata, strata.nccl

    def mapped():
        out = set()
        for line in open("/proc/self/maps"):
            f = line.split()
            if len(f) >= 6 and (os.path.basename(f[5]) == "libnccl.so"
                                or os.path.basename(f[5]).startswith("libnccl.so.")):
                out.add(os.path.realpath(f[5]))
        return sorted(out)

    def version_of(path):
        v = ctypes.c_int()
        assert ctypes.CDLL(path).ncclGetVersion(ctypes.byref(v)) == 0
        code = v.value
        return [code // 10000, code % 10000 // 100, code % 100]

    before = mapped()
    try:
        found = strata.nccl.find()
    except strata.CommError as e:
        print(json.dumps({{"error": str(e)}}))
        sys.exit(0)
    after = mapped()
    topo = strata.topology.detect({fixture!r}, use_nvml=False, read_conf_files=False, env={{}})
    out = {{"torch_imported": "torch" in sys.modules, "before": before, "after": after,
            "found": found, "topology": topo.data["nccl_library"], "topology_text": topo.text(),
            "build_info": strata.build_info()["nccl_library"]}}
    # Last: loading the file through ctypes maps it (for good).
    out["reference_version"] = version_of(found["path"])
    print(json.dumps(out))
""")


def child(setup="", env=None):
    e = dict(os.environ)
    e.pop("STRATA_NCCL_LIBRARY", None)
    e.update(env or {})
    code = CHILD.format(setup=setup, fixture=FIXTURE_SYS)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def no_torch():
    d = child()
    if "error" in d:
        pytest.skip(f"no libnccl on this machine: {d['error']}")
    assert not d["torch_imported"]  # `import strata` does not import torch
    return d


def check_everywhere(d):
    """The same file and reason in every report of one process."""
    found = d["found"]
    assert os.path.isabs(found["path"]) and found["path"] == os.path.realpath(found["path"])
    assert list(found["version"]) == d["reference_version"]
    assert d["topology"] == {"path": found["path"], "source": found["source"],
                             "reason": found["reason"],
                             "version": ".".join(map(str, found["version"]))}
    v = ".".join(map(str, found["version"]))
    assert f"NCCL {v} from {found['path']}\n  why this file: {found['reason']}\n" in \
        d["topology_text"]
    assert d["build_info"] == found


def test_without_torch_the_loaders_file_and_which_search_path_entry():
    d = no_torch()
    found = d["found"]
    assert found["source"] in ("search-path", "built-against"), found
    if found["source"] == "search-path":
        assert found["reason"].startswith(
            "libnccl.so.2 found via the dynamic loader's search path: "), found["reason"]
    else:
        assert found["reason"].startswith("the library strata was built against"), found
    # The report opened the file and closed it again: nothing left for torch
    # to collide with.
    assert d["before"] == [] and d["after"] == []
    check_everywhere(d)


def test_with_torch_imported_first_torchs_copy_and_why():
    d = child(setup="import torch")
    if "error" in d or not d["before"]:
        pytest.skip("this torch build does not load a libnccl")
    found = d["found"]
    assert d["before"] == d["after"] == [found["path"]]
    assert found["source"] == "already-loaded"
    # torch's libtorch_cuda.so links it.
    assert found["reason"].startswith("already loaded in this process by torch ("), found
    assert "/torch/lib/" in found["reason"] and found["reason"].endswith(" links it)")
    check_everywhere(d)
    # The copy differs from the one a process without torch gets, and the
    # reports say why: the point of naming the file.
    plain = no_torch()["found"]
    assert plain["reason"] != found["reason"]


def test_strata_nccl_library_names_the_file():
    path = no_torch()["found"]["path"]
    d = child(env={"STRATA_NCCL_LIBRARY": path})
    assert d["found"]["source"] == "STRATA_NCCL_LIBRARY"
    assert d["found"]["reason"] == f"STRATA_NCCL_LIBRARY={path}"
    assert d["found"]["path"] == path
    check_everywhere(d)


def test_a_file_asked_for_by_the_caller_names_the_option():
    path = no_torch()["found"]["path"]
    code = ("import json, strata, strata.nccl; "
            f"print(json.dumps(strata.nccl.find({path!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "STRATA_NCCL_LIBRARY"})
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert found["source"] == "option" and found["path"] == path
    assert "NcclOptions::library" in found["reason"] and "strata.nccl.library(path)" in found["reason"]


def test_ld_library_path_entry_is_named(tmp_path):
    path = no_torch()["found"]["path"]
    (tmp_path / "libnccl.so.2").symlink_to(path)
    d = child(env={"LD_LIBRARY_PATH": f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}"})
    assert d["found"]["source"] == "search-path"
    assert d["found"]["path"] == path
    # (The link leads to the file this process would find anyway, so the
    # reason may add that it is the one strata was built against.)
    assert d["found"]["reason"].startswith(
        f"libnccl.so.2 found via the dynamic loader's search path: LD_LIBRARY_PATH entry "
        f"{tmp_path};") or d["found"]["reason"] == (
        f"libnccl.so.2 found via the dynamic loader's search path: LD_LIBRARY_PATH entry {tmp_path}")
    check_everywhere(d)


@pytest.mark.skipif(not TOPO, reason="needs STRATA_TOPO_BIN (set by ctest)")
def test_strata_topo_names_the_file_in_text_and_json():
    found = no_torch()["found"]
    args = [TOPO, "--sysfs-root", FIXTURE_SYS, "--no-conf-files"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    env.pop("STRATA_NCCL_LIBRARY", None)
    j = json.loads(subprocess.run(args + ["--json"], capture_output=True, text=True, env=env).stdout)
    # strata-topo links the same libstrata, so the same rule gives the same answer.
    assert j["nccl_library"]["path"] == found["path"]
    assert j["nccl_library"]["source"] == found["source"]
    assert j["nccl_library"]["reason"] == found["reason"]
    assert j["nccl_version"] == ".".join(map(str, found["version"]))
    assert j["nccl_version_source"] == f"ncclGetVersion() of {found['path']}"
    text = subprocess.run(args, capture_output=True, text=True, env=env).stdout
    assert f"NCCL {j['nccl_version']} from {found['path']}\n  why this file: {found['reason']}" in text


@pytest.mark.skipif(not TOPO, reason="needs STRATA_TOPO_BIN (set by ctest)")
def test_strata_topo_says_why_it_found_none():
    env = dict(os.environ, STRATA_NCCL_LIBRARY="/nonexistent/libnccl.so.2")
    r = subprocess.run([TOPO, "--sysfs-root", FIXTURE_SYS, "--no-conf-files", "--json"],
                       capture_output=True, text=True, env=env)
    j = json.loads(r.stdout)
    assert j["nccl_library"] is None
    assert "/nonexistent/libnccl.so.2 (STRATA_NCCL_LIBRARY=/nonexistent/libnccl.so.2)" in \
        j["nccl_version_source"]
    assert j["nccl_version_source"].endswith("linting for the newest NCCL strata knows")
    # --nccl-version loads nothing and says so.
    r = subprocess.run([TOPO, "--sysfs-root", FIXTURE_SYS, "--no-conf-files", "--nccl-version",
                        "2.21.5"], capture_output=True, text=True, env=env)
    assert "NCCL 2.21.5 (given; no libnccl was loaded for this report)" in r.stdout
