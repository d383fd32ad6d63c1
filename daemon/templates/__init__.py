"""Launch templates: typed knobs, sandboxed rendering, and revisions made by typed patches.

A template is a directory holding `template.toml` (name, dialect, knobs, env, sbatch options,
free variables, checkpoint layout) and a Jinja2 sbatch script, or, for a template imported from
an existing script (`imported = true`), that script verbatim and copies of the config files it
names (`[configs]`, under `configs/`): its knobs are read from them, and a render splices
changed values where the script writes them, a config's through a patched copy the script
writes (`daemon.imported`). The directory is the user's: the daemon reads it as its owner
through `daemon.owner_files` (regular files inside the directory, 1 MB each at most), the CLI as
the caller, through the same walk.

One module per idea, imported by name (this package exports nothing itself):
- `model`: the loaded template, its knobs checked, and the one error every step raises;
- `sandbox`: the Jinja whitelist and the shell quoting a render runs under;
- `rendering`: a template and its knobs made into an sbatch script;
- `reading`: `template.toml` and the script read, as the caller or as the owner;
- `revisions`: typed patches, the revisions they make, and their JSON and on-disk home.
"""
