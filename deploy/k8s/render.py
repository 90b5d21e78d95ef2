"""Render a Kustomize overlay of deploy/k8s without the kustomize binary (the subset these files use).

    python deploy/k8s/render.py gpu8                  # = kubectl kustomize deploy/k8s/overlays/gpu8
    python deploy/k8s/render.py deploy/k8s/base       # any directory with a kustomization.yaml
    python deploy/k8s/render.py --write-dashboard     # base/grafana-dashboard.yaml from docs/grafana-dashboard.json

What it does, as kustomize does it: ``resources`` (files, and directories with their own kustomization,
rendered first), ``patches`` (strategic-merge patches from ``path`` or inline ``patch``, applied to the
resource of the patch's kind and name, or to those ``target`` selects; a patch of ``$patch: delete``
removes the resource), ``replicas``, ``images`` (newName, newTag), ``labels`` (``pairs`` on every
resource's metadata, and on pod templates with ``includeTemplates``) and ``namespace``. Lists merge by
kustomize's keys for the fields these files patch (containers and env by name, volumeMounts by mountPath,
...); any other list is replaced. Any other kustomization field is refused by name, so a file that uses
more than this cannot render differently here than with kustomize without a test noticing.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parent
ROOT = K8S.parents[1]
DASHBOARD_JSON = ROOT / "docs" / "grafana-dashboard.json"
DASHBOARD_YAML = K8S / "base" / "grafana-dashboard.yaml"
FIELDS = {"apiVersion", "kind", "resources", "patches", "replicas", "images", "labels", "namespace"}
# Strategic-merge keys of the lists (Kubernetes' patchMergeKey) these files' patches touch.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name",
              "topologySpreadConstraints": "topologyKey"}
DELETE = object()


class RenderError(ValueError):
    """A kustomization this renderer cannot render (or kustomize would refuse); the message names it."""


def merge(base, patch, field: str | None = None):
    """``patch`` merged into ``base`` as a strategic-merge patch (``null`` deletes a key)."""
    if isinstance(patch, dict):
        if patch.get("$patch") == "delete":
            return DELETE
        if not isinstance(base, dict):
            return copy.deepcopy(patch)
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return out
    if isinstance(patch, list) and isinstance(base, list) and field in MERGE_KEYS:
        key, out = MERGE_KEYS[field], copy.deepcopy(base)
        for item in patch:
            at = next((i for i, b in enumerate(out) if isinstance(item, dict) and b.get(key) == item.get(key)), None)
            merged = merge(out[at], item, field) if at is not None else copy.deepcopy(item)
            if at is None:
                out.append(merged)
            elif merged is DELETE:
                del out[at]
            else:
                out[at] = merged
        return out
    return copy.deepcopy(patch)


def selects(target: dict, doc: dict) -> bool:
    meta = doc.get("metadata", {})
    return all(doc.get(k) == target[k] for k in ("kind", "apiVersion") if k in target) and (
        "name" not in target or meta.get("name") == target["name"])


def read_yaml(path: Path) -> list[dict]:
    if not path.is_file():
        raise RenderError(f"{path}: no such file")
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def apply_patches(docs: list[dict], patches: list[dict], where: Path) -> list[dict]:
    for patch in patches:
        body = read_yaml(where / patch["path"])[0] if "path" in patch else yaml.safe_load(patch["patch"])
        if not isinstance(body, dict):
            raise RenderError(f"{where}: only strategic-merge patches (a mapping) are rendered here: {patch}")
        target = patch.get("target") or {"kind": body.get("kind"), "name": body.get("metadata", {}).get("name")}
        hits = [i for i, d in enumerate(docs) if selects(target, d)]
        if not hits:
            raise RenderError(f"{where}: patch {patch.get('path', patch)} matches no resource ({target})")
        for i in hits:
            docs[i] = merge(docs[i], {k: v for k, v in body.items() if k != "metadata" or "target" not in patch})
        docs = [d for d in docs if d is not DELETE]
    return docs


def set_images(docs: list[dict], images: list[dict]) -> None:
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            name, _, tag = c["image"].partition(":")
            for image in images:
                if image["name"] == name:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"


def set_labels(docs: list[dict], labels: list[dict]) -> None:
    for entry in labels:
        if entry.get("includeSelectors"):
            raise RenderError("labels: includeSelectors is not rendered here (selectors are immutable)")
        for doc in docs:
            doc.setdefault("metadata", {}).setdefault("labels", {}).update(entry["pairs"])
            template = doc.get("spec", {}).get("template")
            if entry.get("includeTemplates") and template is not None:
                template.setdefault("metadata", {}).setdefault("labels", {}).update(entry["pairs"])


def build(directory: Path) -> list[dict]:
    """The resources of the kustomization in ``directory``, rendered."""
    kfile = directory / "kustomization.yaml"
    if not kfile.is_file():
        raise RenderError(f"{directory}: no kustomization.yaml")
    k = yaml.safe_load(kfile.read_text()) or {}
    unknown = sorted(set(k) - FIELDS)
    if unknown:
        raise RenderError(f"{kfile}: field(s) {', '.join(unknown)} are not rendered here")
    docs: list[dict] = []
    for res in k.get("resources", []):
        path = directory / res
        docs += build(path) if path.is_dir() else read_yaml(path)
    docs = apply_patches(docs, k.get("patches", []), directory)
    for r in k.get("replicas", []):
        hits = [d for d in docs if d.get("metadata", {}).get("name") == r["name"] and "replicas" in d.get("spec", {})]
        if not hits:
            raise RenderError(f"{kfile}: replicas: no workload named {r['name']}")
        for d in hits:
            d["spec"]["replicas"] = r["count"]
    set_images(docs, k.get("images", []))
    set_labels(docs, k.get("labels", []))
    if "namespace" in k:
        for d in docs:
            d.setdefault("metadata", {})["namespace"] = k["namespace"]
    return docs


def overlay_dir(name: str) -> Path:
    path = Path(name)
    return path if (path / "kustomization.yaml").exists() else K8S / "overlays" / name


def render(name: str) -> str:
    return yaml.safe_dump_all(build(overlay_dir(name)), sort_keys=False)


def dashboard_configmap() -> str:
    """base/grafana-dashboard.yaml: docs/grafana-dashboard.json as a ConfigMap for Grafana's sidecar."""
    doc = {"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": "eyrie-grafana-dashboard", "labels": {"grafana_dashboard": "1"}},
           "data": {"eyrie.json": json.dumps(json.loads(DASHBOARD_JSON.read_text()), indent=1) + "\n"}}
    head = "# Generated from docs/grafana-dashboard.json by `python deploy/k8s/render.py --write-dashboard`.\n"
    return head + yaml.dump(doc, Dumper=_LiteralDumper, sort_keys=False, width=120)


class _LiteralDumper(yaml.SafeDumper):
    """Multi-line strings as ``|`` blocks (the dashboard's JSON stays readable in the ConfigMap)."""


_LiteralDumper.add_representer(str, lambda dumper, s: dumper.represent_scalar(
    "tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overlay", nargs="?", help="an overlay's name (deploy/k8s/overlays/NAME) or a directory")
    p.add_argument("--write-dashboard", action="store_true", help="regenerate base/grafana-dashboard.yaml")
    args = p.parse_args(argv)
    if args.write_dashboard:
        DASHBOARD_YAML.write_text(dashboard_configmap())
        return 0
    if not args.overlay:
        p.error("name an overlay or a directory")
    try:
        sys.stdout.write(render(args.overlay))
    except RenderError as e:
        print(f"render: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
