"""Helpers shared by test files of several folders (assertions, tiny configs, layout set-ups)."""
