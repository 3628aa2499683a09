"""Every config field's default, meaning and allowed values; config files."""
