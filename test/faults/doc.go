// Package faults proves that credbroker fails closed, fails fast and
// recovers by itself when the network and the API servers around it fail.
//
// Its tests start a hub and two spokes (test/framework), a broker and the
// agents, with a loopback proxy the tests control
// (internal/testing/faultproxy) on each path that a fault cuts: broker→hub,
// agent→broker and agent→spoke.
// Each fault test checks the gRPC code consumers see, that no call outlives
// its deadline, that service comes back without restarting anything, and
// that no mint stays pending. docs/operations.md gives the detection bound
// of each fault.
package faults
