package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"k8s.io/apimachinery/pkg/util/duration"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// printList prints grants as a table, like kubectl get, or as the
// response's proto JSON. An empty table is a line on errOut, as kubectl
// says "No resources found".
func printList(out, errOut io.Writer, format string, resp *pb.ListGrantsResponse, now time.Time) error {
	if format == outputJSON {
		return printJSON(out, resp)
	}
	if len(resp.GetGrants()) == 0 {
		_, err := fmt.Fprintln(errOut, "No grants found.")
		return err
	}
	return printTable(out, resp.GetGrants(), now)
}

func printTable(out io.Writer, grants []*pb.Grant, now time.Time) error {
	w := tabwriter.NewWriter(out, 0, 8, 3, ' ', 0)
	fmt.Fprintln(w, "CLUSTER\tCREDENTIAL-ID\tSUBJECT\tSERVICE-ACCOUNT\tEXPIRES")
	for _, g := range grants {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\n",
			cell(ref(g.GetCluster())), cell(g.GetCredentialId()), cell(g.GetSubject().GetUsername()),
			cell(ref(g.GetServiceAccount())), expires(g, now))
	}
	return w.Flush()
}

// printRevoke prints what was revoked and what is pending, or the
// response's proto JSON.
func printRevoke(out io.Writer, format string, resp *pb.RevokeGrantsResponse) error {
	if format == outputJSON {
		return printJSON(out, resp)
	}
	for _, g := range resp.GetRevoked() {
		fmt.Fprintf(out, "revoked %s\n", describeGrant(g))
	}
	for _, g := range resp.GetPending() {
		fmt.Fprintf(out, "pending %s: its agent is not connected to this broker replica or failed; the revoke is recorded on the hub, and every broker replica sends it again when the agent connects or reports the grant\n",
			describeGrant(g))
	}
	return nil
}

func describeGrant(g *pb.Grant) string {
	return fmt.Sprintf("%s (cluster %s, subject %s, service account %s)",
		cell(g.GetCredentialId()), cell(ref(g.GetCluster())), cell(g.GetSubject().GetUsername()), cell(ref(g.GetServiceAccount())))
}

func printJSON(out io.Writer, m proto.Message) error {
	b, err := protojson.Marshal(m)
	if err != nil {
		return fmt.Errorf("encode the answer as JSON: %w", err)
	}
	// protojson varies its white space on purpose; indent it the same way
	// every time.
	var buf bytes.Buffer
	if err := json.Indent(&buf, b, "", "  "); err != nil {
		return fmt.Errorf("indent the answer's JSON: %w", err)
	}
	buf.WriteByte('\n')
	_, err = buf.WriteTo(out)
	return err
}

func ref(r *pb.ObjectReference) string {
	if r == nil {
		return ""
	}
	return r.GetNamespace() + "/" + r.GetName()
}

// expires is the time left, as kubectl prints ages, with "expired" for
// grants past their expiry.
func expires(g *pb.Grant, now time.Time) string {
	if g.GetExpirationTime() == nil {
		return "<unknown>"
	}
	left := g.GetExpirationTime().AsTime().Sub(now)
	if left <= 0 {
		return "expired"
	}
	return duration.HumanDuration(left)
}

// cell makes what the agents reported safe for a terminal: no control
// characters, tabs or line breaks, "<none>" for nothing.
func cell(s string) string {
	if s == "" || s == "/" {
		return "<none>"
	}
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			return '?'
		}
		return r
	}, s)
}
