"""The ClientApp (``clientapp.py``), the device's site policy (``policy/``) and the attack harness (``attacks.py``)."""
