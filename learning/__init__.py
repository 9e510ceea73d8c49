"""The torch kit both roles use: the task interface and built-in tasks, models, training, data sets."""
