"""Figures are regenerated from run records (never edited by hand): each module globs records and plots."""
