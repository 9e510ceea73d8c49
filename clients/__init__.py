"""The ClientApp (``clientapp.py``) and the Byzantine attack harness it runs as a mod (``attacks.py``)."""
