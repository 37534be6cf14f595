"""Why an accumulated gradient differs from the big batch's: the comparison,
the probes, the causes and the report."""
