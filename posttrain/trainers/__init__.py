"""posttrain.trainers."""
