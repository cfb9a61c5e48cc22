package e2e

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/credbroker/credbroker/pkg/spoke"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// hubNamespaceGroup is the hub group of every ServiceAccount in c's
// namespace, as the hub's TokenReview reports it.
func hubNamespaceGroup(c consumer) string { return "system:serviceaccounts:" + c.namespace }

// withClaimedGroups returns req with groups appended as fields the
// ExchangeRequest message does not define, at every free field number up
// to 15, both as strings and as a nested Subject (username, uid, groups),
// so that a broker that read any of them would be caught.
func withClaimedGroups(req *pb.ExchangeRequest, user string, groups ...string) *pb.ExchangeRequest {
	var subject []byte
	subject = protowire.AppendTag(subject, 1, protowire.BytesType)
	subject = protowire.AppendString(subject, user)
	for _, g := range groups {
		subject = protowire.AppendTag(subject, 3, protowire.BytesType)
		subject = protowire.AppendString(subject, g)
	}
	var unknown []byte
	fields := req.ProtoReflect().Descriptor().Fields()
	for n := protowire.Number(1); n <= 15; n++ {
		if fields.ByNumber(n) != nil {
			continue
		}
		for _, g := range groups {
			unknown = protowire.AppendTag(unknown, n, protowire.BytesType)
			unknown = protowire.AppendString(unknown, g)
		}
		unknown = protowire.AppendTag(unknown, n, protowire.BytesType)
		unknown = protowire.AppendBytes(unknown, subject)
	}
	req.ProtoReflect().SetUnknown(protoreflect.RawFields(unknown))
	return req
}

// The attack: a hub consumer that is not in a group claims it, to get a
// token from a spoke ServiceAccount that allows the group. The groups the
// agent matches are those the hub's TokenReview reports for the consumer's
// own token: a consumer in the group gets a token, one outside is refused,
// whatever its request or its metadata say.
func TestGroupSubjects(t *testing.T) {
	cluster := env.Spokes[0]
	inside := newConsumer(t, "credbroker", cluster.Name)
	outside := newConsumer(t, "credbroker", cluster.Name)
	ns := optIn(t, cluster, "by-group", spoke.GroupSubjectPrefix+hubNamespaceGroup(inside))
	named := func() *pb.ExchangeRequest {
		return &pb.ExchangeRequest{
			Cluster:        clusterRef(cluster),
			ServiceAccount: &pb.ObjectReference{Namespace: ns, Name: "by-group"},
		}
	}

	t.Run("a consumer in the group gets a token", func(t *testing.T) {
		resp, err := exchange(t, inside, named())
		require.NoError(t, err)
		require.NoError(t, selfReview(t, cluster, resp.GetToken()), "the spoke refuses a fresh token")
		assert.Equal(t, "system:serviceaccount:"+ns+":by-group", claims(t, resp.GetToken()).Sub)
	})

	t.Run("a consumer in another namespace is refused", func(t *testing.T) {
		_, err := exchange(t, outside, named())
		require.Equal(t, codes.PermissionDenied, status.Code(err), "err: %v", err)
		assert.Contains(t, status.Convert(err).Message(), "does not allow hub user "+outside.username())
	})

	t.Run("the request cannot claim a group", func(t *testing.T) {
		// ExchangeRequest has no field for the caller's identity: the
		// broker takes it from TokenReview.
		fields := named().ProtoReflect().Descriptor().Fields()
		var names []string
		for i := range fields.Len() {
			names = append(names, string(fields.Get(i).Name()))
		}
		slices.Sort(names)
		assert.Equal(t, []string{"audiences", "cluster", "expiration_seconds", "service_account"}, names,
			"a field added to ExchangeRequest must never carry the caller's groups")

		// Fields it does not define, and headers that mean impersonation
		// to an API server, are ignored.
		req := withClaimedGroups(named(), inside.username(), hubNamespaceGroup(inside))
		ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(bearer(outside.token),
			"impersonate-user", inside.username(),
			"impersonate-group", hubNamespaceGroup(inside),
			"x-remote-user", inside.username(),
			"x-remote-group", hubNamespaceGroup(inside),
		), 30*time.Second)
		defer cancel()
		resp, err := exchangeClient(t).Exchange(ctx, req)
		if err == nil {
			minted.Lock()
			minted.tokens = append(minted.tokens, resp.GetToken())
			minted.Unlock()
		}
		require.Equal(t, codes.PermissionDenied, status.Code(err), "a consumer that claims a group got a token: %v", err)
		assert.Contains(t, status.Convert(err).Message(), "does not allow hub user "+outside.username())
	})
}

// The attack: a spoke admin removes a group entry from a ServiceAccount,
// and the members of that group go on using the tokens they already hold.
// The spoke must refuse the tokens allowed only by that group within 20 s,
// and only them: each grant is judged by the hub groups it recorded.
func TestWithdrawnGroupEntryRevokesIssuedTokens(t *testing.T) {
	cluster := env.Spokes[0]
	gone := newConsumer(t, "credbroker", cluster.Name)
	stays := newConsumer(t, "credbroker", cluster.Name)
	byName := newConsumer(t, "credbroker", cluster.Name)
	// One ServiceAccount allows two groups and one username; each
	// consumer has its own hub namespace, so each is in its own group only.
	ns := optIn(t, cluster, "shared",
		spoke.GroupSubjectPrefix+hubNamespaceGroup(gone),
		spoke.GroupSubjectPrefix+hubNamespaceGroup(stays),
		byName.username())
	// Another ServiceAccount allows gone's group too.
	otherNS := optIn(t, cluster, "other", spoke.GroupSubjectPrefix+hubNamespaceGroup(gone))

	goneResp := mintOn(t, cluster, cluster.Name, gone, ns, "shared")
	staysTok := mintOn(t, cluster, cluster.Name, stays, ns, "shared").GetToken()
	byNameTok := mintOn(t, cluster, cluster.Name, byName, ns, "shared").GetToken()
	goneOtherTok := mintOn(t, cluster, cluster.Name, gone, otherNS, "other").GetToken()

	changed := setAnnotation(t, cluster, ns, "shared", spoke.AllowedSubjectsAnnotation,
		spoke.GroupSubjectPrefix+hubNamespaceGroup(stays)+","+byName.username())
	refusedAfter(t, cluster, goneResp.GetToken(), changed, "its group entry was removed")
	assert.NoError(t, selfReview(t, cluster, staysTok), "a token allowed by a group still listed was revoked")
	assert.NoError(t, selfReview(t, cluster, byNameTok), "a token allowed by name was revoked")
	assert.NoError(t, selfReview(t, cluster, goneOtherTok), "a token of another ServiceAccount that still allows the group was revoked")
	line := logLine(t, `"msg"="revoked grant"`, `"credentialID"="`+goneResp.GetCredentialId()+`"`, `"subject"="`+gone.username()+`"`)
	assert.NotContains(t, line, goneResp.GetToken())
}
