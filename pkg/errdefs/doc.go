// Package errdefs defines the errors that credbroker's components share, and
// the one place where they become gRPC statuses.
//
// Code anywhere in credbroker wraps one of the sentinel errors with context:
//
//	return fmt.Errorf("clusterprofile %s/%s: %w", ns, name, errdefs.ErrNotFound)
//
// and the gRPC edge calls ToStatus once, which picks the code from the
// sentinel and keeps the wrapped message, which callers are meant to read.
// Errors that match no sentinel become codes.Internal with a generic message,
// so internal detail never reaches a caller. Messages must never contain a
// token; see package token for safe ways to refer to one.
package errdefs
