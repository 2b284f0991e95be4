"""Day 28: the capstone, a ~125M GPT trained with every strategy of the course."""
