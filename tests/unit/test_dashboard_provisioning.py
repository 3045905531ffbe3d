"""Grafana file provisioning of dashboards/serve_app.json: the data source and dashboard
provider files parse, the provider loads the folder that holds the dashboard, and every
data source reference in the dashboard resolves without the UI import's __inputs step
(file provisioning does not substitute ${DS_...} inputs; a data source variable does)."""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath

import pytest
import yaml
from dashboard_panels import DASHBOARD, all_panels

DASHBOARDS = DASHBOARD.parent
PROVISIONING = DASHBOARDS / "provisioning"
DATASOURCES = PROVISIONING / "datasources" / "prometheus.yaml"
PROVIDER = PROVISIONING / "dashboards" / "serve_app.yaml"
# Variables Grafana defines itself.
BUILTIN = re.compile(r"^__\w+$")
# ${name}, ${name:format}, $name, [[name]]
REFERENCE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\$(\w+)|\[\[(\w+)\]\]")


def _grafana_expand(value: str, environ: dict[str, str]) -> str:
    """Grafana's provisioning interpolation: os.ExpandEnv on each part between "$$"
    ($VAR and ${VAR} only: no ${VAR:-default})."""
    def one(part: str) -> str:
        return re.sub(r"\$\{([^}]*)\}|\$([A-Za-z0-9_]+)", lambda m: environ.get(m.group(1) or m.group(2), ""), part)

    return "$".join(one(part) for part in value.split("$$"))


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def datasource() -> dict:
    config = yaml.safe_load(DATASOURCES.read_text())
    assert config["apiVersion"] == 1
    (source,) = config["datasources"]
    return source


@pytest.fixture(scope="module")
def provider() -> dict:
    config = yaml.safe_load(PROVIDER.read_text())
    assert config["apiVersion"] == 1
    (entry,) = config["providers"]
    return entry


def _strings(node, path="$"):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _strings(value, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node


def test_datasource_is_prometheus_with_a_fixed_uid_and_its_url_from_the_environment(datasource):
    assert datasource["type"] == "prometheus"
    assert datasource["uid"] == "serve-app-prometheus"
    assert datasource["access"] == "proxy"
    url = datasource["url"]
    # An environment reference Grafana itself expands (it has no default syntax).
    assert re.fullmatch(r"\$\{?PROMETHEUS_URL\}?", url), url
    assert _grafana_expand(url, {"PROMETHEUS_URL": "http://prometheus:9090"}) == "http://prometheus:9090"
    # Not the org's default: it can sit beside another provisioned default data source.
    assert datasource.get("isDefault") is False


def test_provider_loads_the_folder_that_holds_the_dashboard(provider):
    assert provider["type"] == "file"
    path = PurePosixPath(provider["options"]["path"])
    assert path.is_absolute(), path
    # The provider file documents the mount that puts dashboards/ at that path; Grafana
    # walks it for *.json files (subfolders too), and this is the only one there.
    mounts = dict(re.findall(r'-v\s+"?\$PWD/([\w./-]+):([\w./-]+?)(?::ro)?"?(?:\s|$)', PROVIDER.read_text()))
    sources = [src for src, dst in mounts.items() if PurePosixPath(dst) == path]
    assert sources, f"no documented -v mount onto {path}: {mounts}"
    (source,) = sources
    folder = Path(__file__).resolve().parents[2] / source
    assert folder.resolve() == DASHBOARDS.resolve()
    assert (folder / DASHBOARD.name).is_file()
    assert sorted(p.relative_to(folder) for p in folder.rglob("*.json")) == [Path(DASHBOARD.name)]
    assert provider["options"].get("foldersFromFilesStructure") is not True


def test_dashboard_has_no_import_inputs_and_a_datasource_variable(dashboard, datasource):
    assert "__inputs" not in dashboard  # only the UI import fills those; provisioning would not
    variables = dashboard["templating"]["list"]
    sources = [v for v in variables if v["type"] == "datasource"]
    assert [v["name"] for v in sources] == ["DS_PROMETHEUS"]
    (variable,) = sources
    assert variable["query"] == "prometheus"
    # First, so the query variables that use it resolve after it; on a provisioned Grafana
    # it starts on the provisioned data source (any other Prometheus: the variable's list).
    assert variables[0] is variable
    assert variable["current"]["value"] == datasource["uid"]
    assert not variable.get("multi") and not variable.get("includeAll")


def test_every_datasource_resolves_to_the_variable_or_the_provisioned_uid(dashboard, datasource):
    variable_names = {v["name"] for v in dashboard["templating"]["list"] if v["type"] == "datasource"}
    allowed = {datasource["uid"]} | {ref for name in variable_names for ref in (f"${{{name}}}", f"${name}")}

    def check(where: str, ref) -> None:
        assert isinstance(ref, dict), f"{where}: datasource {ref!r} (a name, not a {{type, uid}} reference)"
        assert ref.get("type") == "prometheus", f"{where}: {ref}"
        assert ref.get("uid") in allowed, f"{where}: datasource uid {ref.get('uid')!r} is neither {sorted(allowed)}"

    checked = 0
    for panel in all_panels(dashboard["panels"]):
        where = f"panel {panel.get('title')!r}"
        if panel.get("type") == "row":
            assert not panel.get("targets"), where
            continue
        check(where, panel.get("datasource"))
        for target in panel.get("targets", []):
            # A target without its own data source uses the panel's.
            if "datasource" in target:
                check(f"{where} target {target.get('refId')}", target["datasource"])
            checked += 1
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            check(f"variable {variable['name']}", variable.get("datasource"))
    assert checked >= 20


def test_no_unresolved_variable_or_input_reference_remains(dashboard):
    names = {v["name"] for v in dashboard["templating"]["list"]}
    unresolved = []
    for where, text in _strings(dashboard):
        for match in REFERENCE.finditer(text):
            name = next(group for group in match.groups() if group)
            if name not in names and not BUILTIN.match(name):
                unresolved.append(f"{where}: {match.group(0)}")
    assert not unresolved, unresolved


def test_variables_refer_only_to_variables_defined_before_them(dashboard):
    defined: set[str] = set()
    for variable in dashboard["templating"]["list"]:
        for _, text in _strings(variable):
            for match in REFERENCE.finditer(text):
                name = next(group for group in match.groups() if group)
                assert BUILTIN.match(name) or name in defined, \
                    f"variable {variable['name']} uses ${name} before it is defined"
        defined.add(variable["name"])

