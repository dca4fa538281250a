"""The config reference: every key with its default, type and meaning, in Markdown (`ddpkit train --help-config`,
docs/config.md)."""

from __future__ import annotations

from ddpkit.config import key_specs, section_fields
from ddpkit.config.schema import MAX_TEXT, yaml_text

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
        n: f"`{n}`: {f.default_factory.__doc__}" for n, f in section_fields().items()
    }
    for sec, title in titles.items():
        lines += ["", f"## {title}", ""]
        for spec in key_specs().values():
            if spec.key.rpartition(".")[0] == sec:
                lines += [
                    f"- `{spec.key} = {yaml_text(spec.default)}` ({spec.type_text()}):",
                    f"  {spec.meta.meaning}",
                ]
    return "\n".join(lines)
