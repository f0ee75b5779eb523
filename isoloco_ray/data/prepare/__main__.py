"""`python -m isoloco_ray.data.prepare`: the preparation CLI (cli.py)."""

from isoloco_ray.data.prepare.cli import main

raise SystemExit(main())
