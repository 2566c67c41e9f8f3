"""Helpers: teachers and data sets to measure on, comparisons of runs, tables from results files."""
