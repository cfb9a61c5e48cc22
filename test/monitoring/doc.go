// Package monitoring checks deploy/monitoring: every alert expression and
// every dashboard query parses as PromQL, and deploy/monitoring/metric-names.txt
// lists exactly the metric names they use. It is a module of its own so
// that the weight of github.com/prometheus/prometheus stays out of the main
// go.mod; the main module's e2e test reads metric-names.txt and checks that
// a running broker and agent expose every name.
package monitoring
