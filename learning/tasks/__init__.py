"""The built-in tasks: written against ``learning.task.Task`` like any user's, named by entry."""
