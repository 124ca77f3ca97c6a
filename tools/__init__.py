"""The command-line tools, installed as `megalite.tools` (setup.py) so the console scripts
(megalite-plan, megalite-convert, megalite-preprocess) can import them; in a checkout each runs as
a script: `python tools/plan.py ...`."""
