// Package selector holds the rules for the wire form of a grant selector
// (pb.GrantSelector): which credential ids, usernames and ClusterProfiles a
// caller may ask the Grants API about. The broker's Grants service applies
// them to every call, and the credbroker CLI to its flags before it dials,
// so that both refuse alike; the CLI so needs none of the broker's
// packages.
//
//	if err := selector.Check(&pb.GrantSelector{CredentialId: "JTI=0b6c…"}); err != nil {
//		return err // wraps errdefs.ErrInvalidArgument
//	}
//
// Clip makes what a caller sent fit for messages and logs, and IsControl
// and IsCredentialID are the character and credential id rules of the
// checks, which the Grants service applies to the rest of what it is sent.
package selector
