tandem_add_dist_test(dist_placeholder 2 "*")
