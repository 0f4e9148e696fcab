"""An update's work on the device: its token columns, the packed block of columns and aggregates, the one host copy."""
