"""``python -m draftline.patchq``: the command line (draftline.patchq.cli)."""

from draftline.patchq.cli import main

main()
