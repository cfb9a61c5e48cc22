// Package serverurl holds the one rule for the URL of a spoke API server
// that a bearer token may be sent to, and shows such a URL without its
// password.
//
// The broker (before it serves a ClusterProfile's server), the publisher
// (before it pins or publishes one), the client library and
// credbroker-plugin (before they hand a token to one) all apply Check, so
// that a server one of them accepts is accepted by all: an entry the broker
// serves is one the publisher pins, and so one the agents cannot repoint.
//
// The package imports nothing of the project.
package serverurl
