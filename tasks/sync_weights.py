"""Weight sync (trainer side); see the module docstring once written."""
