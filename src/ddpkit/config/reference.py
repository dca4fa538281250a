"""The config reference: every key with its default, type and meaning, in Markdown (`ddpkit train --help-config`,
docs/config.md); a section's own keys first, then those each model family or compression method declares, under
its name."""

from __future__ import annotations

import dataclasses

from ddpkit.config.declared import key_sets, meaning
from ddpkit.config.schema import MAX_TEXT, yaml_text
from ddpkit.config.sections import key_specs, section_fields

_INTRO = """\
# Config keys

A run's config is the defaults below, then a YAML file (`-c FILE.yaml`: nested sections or dotted keys), then
`KEY=VALUE` overrides on the command line (dotted keys); the later one wins. `out_dir/config.yaml` records the
result. This page is the output of `ddpkit train --help-config`.

Words: a *micro-batch* is what one process feeds forward at once (`train.batch_size` samples); an *optimizer
step* is one update, after `train.grad_accum_steps` micro-batches; the *global batch* is `train.batch_size` x
world_size x `train.grad_accum_steps` samples per optimizer step.

Values: `null` means "not set" where a key allows it; numbers must be finite (nan and inf are refused);
strings hold at most {max_text} characters, no control characters and no `${{` (nothing is interpolated).
Every unknown key is reported at once, each with the closest valid key. A config file holds at most {max_mib} MiB,
{max_nodes} values (aliases counted at their expanded size) and {max_depth} levels of nesting, and never the same
key twice."""


def describe_keys() -> str:
    """The config reference in Markdown: every key with its default, type and meaning (docs/config.md)."""
    from ddpkit.config import safe_yaml as y

    limits = {"max_mib": y.MAX_FILE_BYTES >> 20, "max_nodes": y.MAX_NODES, "max_depth": y.MAX_DEPTH}
    lines = [_INTRO.format(max_text=MAX_TEXT, **limits)]
    titles = {"": "Top level"} | {
        n: f"`{n}`: {f.metadata['cls'].__doc__}" for n, f in section_fields().items()
    }
    specs = key_specs()
    for sec, title in titles.items():
        sets = key_sets(sec) if sec else []
        owned = {f"{sec}.{f.name}" for s in sets for f in dataclasses.fields(s.keys)}
        lines += ["", f"## {title}", ""]
        lines += _listed(s for s in specs.values() if s.key.rpartition(".")[0] == sec and s.key not in owned)
        for key_set in sets:  # the keys a model family or a compression method declares, under its name
            lines += ["", f"### {key_set.title}", ""]
            lines += _listed(specs[f"{sec}.{f.name}"] for f in dataclasses.fields(key_set.keys))
    return "\n".join(lines)


def _listed(specs) -> list[str]:
    out: list[str] = []
    for spec in specs:
        out += [
            f"- `{spec.key} = {yaml_text(spec.default)}` ({spec.type_text()}):",
            f"  {meaning(spec.key, spec.meta.meaning)}",
        ]
    return out
