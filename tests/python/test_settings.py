"""strata's settings registry from Python and the command line: the values
in force and where they came from, a bad value rejected by name,
docs/settings.md generated from the registry, every variable documented on
the page the registry names, and no STRATA_* variable read around it."""

import os
import re
import subprocess

import pytest

import strata

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
CLI = os.environ.get("STRATA_TOPO_BIN")


def test_settings_say_value_default_and_source():
    s = strata.settings({"STRATA_GLOO_CMA": "false", "STRATA_LAUNCHER": "MPIRUN"})
    assert s["STRATA_GLOO_CMA"] == strata.Setting(
        name="STRATA_GLOO_CMA", value="0", source="environment", default="1", type="bool",
        choices="", meaning=s["STRATA_GLOO_CMA"].meaning, doc="docs/launch.md")
    assert s["STRATA_LAUNCHER"].value == "mpirun" and s["STRATA_LAUNCHER"].type == "choice"
    assert s["STRATA_STORE"].value == "" and s["STRATA_STORE"].source == "default"
    assert set(strata.settings({})) == set(s)
    before = os.environ.pop("STRATA_STORE", None)
    try:
        os.environ["STRATA_STORE"] = "file:/tmp/strata-settings-test"
        assert strata.settings()["STRATA_STORE"].value == "file:/tmp/strata-settings-test"
        del os.environ["STRATA_STORE"]
        assert strata.settings()["STRATA_STORE"].source == "default"  # nothing cached
    finally:
        if before is not None:
            os.environ["STRATA_STORE"] = before


def test_a_bad_value_is_rejected_by_name():
    with pytest.raises(strata.InvalidArgument,
                       match=r"STRATA_GLOO_CMA='maybe' is not a boolean \(0/1/true/false\)"):
        strata.settings({"STRATA_GLOO_CMA": "maybe"})
    with pytest.raises(strata.LaunchError, match="STRATA_LAUNCHER='pbs' is not one of none"):
        strata.launch_env({"STRATA_LAUNCHER": "pbs"})
    # Launcher detection reads every setting of the environment it is given.
    with pytest.raises(strata.LaunchError, match="STRATA_OVERSUBSCRIBED='2'"):
        strata.launch_env({"STRATA_OVERSUBSCRIBED": "2"})


@pytest.mark.skipif(not CLI, reason="STRATA_TOPO_BIN not set (run through ctest)")
def test_strata_topo_lists_the_settings_in_force():
    env = dict(os.environ, STRATA_GLOO_CMA="0", STRATA_NCCL_LIBRARY="/opt/nccl/libnccl.so.2")
    out = subprocess.run([CLI, "--settings"], capture_output=True, text=True, env=env, check=True)
    lines = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()}
    assert lines["STRATA_GLOO_CMA"] == ["0", "environment"]
    assert lines["STRATA_NCCL_LIBRARY"] == ["/opt/nccl/libnccl.so.2", "environment"]
    assert lines["STRATA_GLOO_DEEPBIND"] == ["1", "default"]
    assert set(lines) == set(strata.settings())
    env["STRATA_GLOO_CMA"] = "maybe"
    bad = subprocess.run([CLI, "--settings"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "STRATA_GLOO_CMA='maybe' is not a boolean" in bad.stderr


@pytest.mark.skipif(not CLI, reason="STRATA_TOPO_BIN not set (run through ctest)")
def test_the_settings_page_is_generated_from_the_registry():
    table = subprocess.run([CLI, "--list-settings"], capture_output=True, text=True, check=True)
    with open(os.path.join(ROOT, "docs", "settings.md")) as f:
        doc = f.read()
    assert doc.endswith(table.stdout), "regenerate the table of docs/settings.md (see the page)"


def test_every_setting_is_documented_where_the_registry_says():
    for name, s in strata.settings({}).items():
        with open(os.path.join(ROOT, s.doc)) as f:
            assert name in f.read(), f"{name} is not mentioned in {s.doc}"


def test_nothing_reads_a_strata_variable_around_the_registry():
    """getenv("STRATA_...") only in the registry and the Gloo plugin (which
    cannot link it); os.environ reads of STRATA_* nowhere in the package."""
    allowed = {os.path.join("src", "base", "settings.cc"),
               os.path.join("src", "comm", "gloo", "plugin", "host_copy.cc")}
    c_read = re.compile(r'getenv\(\s*"STRATA_')
    py_read = re.compile(r'environ(\.get\(|\[)\s*["\']STRATA_|getenv\(\s*["\']STRATA_')
    found = []
    for top in ("src", "include", os.path.join("python", "src"), os.path.join("python", "strata"),
                "tools"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, ROOT)
                if not name.endswith((".cc", ".h", ".py")) or rel in allowed:
                    continue
                with open(path, errors="replace") as f:
                    text = f.read()
                pattern = py_read if name.endswith(".py") else c_read
                found += [f"{rel}: {m.group(0)}" for m in pattern.finditer(text)]
    assert not found, found
