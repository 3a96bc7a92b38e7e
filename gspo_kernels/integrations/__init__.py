"""Drop-in adapters for trainers people already run (import the submodule you need: ``.trl``, ``.verl``)."""
