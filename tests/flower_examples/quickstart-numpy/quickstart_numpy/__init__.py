"""quickstart-numpy: A Flower / NumPy app."""
