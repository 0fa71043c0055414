"""What predicts and measures, apart from the training path: the memory estimator (estimate,
--fit, fake traces), the roofline, bench and check."""
